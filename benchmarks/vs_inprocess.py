"""realrl against a synchronous loop of its own trainer code in one process.

    python benchmarks/vs_inprocess.py [--quick] [--steps N] [--eval-every N] [--target ACC] [--model DIR]
                                      [--transport disk,broadcast] [--json PATH] [--no-prox-recompute]
                                      [--device cuda] [override ...]

`--model DIR` runs both sides on a model directory of your own (e.g. a ~100M
random Qwen2.5: `python -m realrl.impl.random_models qwen2.5 DIR
--hidden-size 768 --layers 12 --intermediate-size 3072`) with its chat template, on
`dataset.train_path` or, when not given, the synthetic arithmetic written
next to the runs. Both sides report steps/min and generated tokens/s.

The in-process loop is the floor that orchestration has to beat: the same
model (the tiny kit, found or built first, by default under /tmp/kit when that
exists), data, seed, batch shape, learning rate and loss as
`realrl/configs/async-ppo.yaml` (16 prompts x 8 answers, 8 new tokens,
GRPO with the decoupled PPO loss), with no servers, no streams and no other
process. Each step:

1. generate: the next 16 prompts in the rollout worker's order (its
   per-epoch shuffle seeded by (seed, 0, epoch)) run as episodes of the
   run's own agent ("single-step") and environment ("math",
   answer_format="exact") -- the same decoding, scoring and reward shaping;
   their generation requests are batched into one HF `model.generate` call
   (128 rows, sampling at the run's temperature, no top-k / top-p), whose
   logits give the behaviour logprobs;
2. `SequenceBatch.from_trajectories`, `PPOTrainer.inference` (proximal
   logprobs as the decoupled loss takes them: with one minibatch, from the
   train forward itself; `--no-prox-recompute` skips it and uses the
   behaviour logprobs, which on-policy are the same numbers) and
   `PPOTrainer.train_step`, built as realrl/system/model_worker.py builds them.

torch runs on all cores (torch.set_num_threads(os.cpu_count())); `--device
cuda` runs the loop on the GPU and the realrl run with `train.device=cuda
server.torch.device=cuda`. Every
`--eval-every` steps (and before the first, and after the last) both sides
score greedy accuracy on the first 128 test prompts with the same code
(realrl/impl/evaluation.py: the agent's evaluation settings, one batched
greedy `generate`); evaluation time is not training time on either side.

Then the full realrl run (`training/main_async_ppo.py` defaults plus the same
step budget, seed and evaluation schedule). Reported for both: steps/min
(train steps over the summed step times: realrl's `time/step_s`, the loop's
generate + inference + train), seconds per stage, the eval accuracy curve,
the training time until the first evaluation at or above `--target`, and the
wall time of the whole command. `--transport disk,broadcast` runs realrl
once per weight transport (`weights.transport`, docs/design.md §8), each
against the same in-process loop, in one sitting. `--json PATH` writes it all
with a top-level "ratio" = realrl steps/min / in-process steps/min (of the
first transport; each one's under "transports"). Extra arguments are Hydra
overrides applied to both sides where they apply (model, data, ppo, optimizer,
rollout.gconfig, eval) and to the realrl run as a whole.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
if "--omp-passive" in sys.argv:  # before torch (and its OpenMP runtime) loads; the realrl workers inherit it too
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from realrl.api.agent_api import PromptRecord, make_agent  # noqa: E402
from realrl.api.env_api import make_env  # noqa: E402
from realrl.api.generation_api import GenerationRequest, GenerationResult  # noqa: E402
from realrl.experiment.build import resolve_model_and_data  # noqa: E402
from realrl.experiment.config import agent_settings, env_config, load_config  # noqa: E402
from realrl.experiment.run import run_experiment  # noqa: E402

# ---- generation in this process ---------------------------------------------------------


@dataclasses.dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future


class SamplingGenerator:
    """The episodes' generation requests, batched into one sampling
    `model.generate` per round (each request's `group_size` answers are rows
    of it), with the behaviour logprobs log_softmax(logits / T) of every
    sampled token -- what the generation servers return."""

    def __init__(self, model, tokenizer, version: int, stop_ids: set[int]):
        self.model, self.tokenizer, self.version = model, tokenizer, version
        self.device = model.device
        self.stop_ids = stop_ids
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._pending: list[_Pending] = []
        self.seconds = 0.0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(request, future))
        return await future

    async def serve(self, episodes_done) -> None:
        while True:
            await asyncio.sleep(0)  # every runnable episode submits first
            batch, self._pending = self._pending, []
            if batch:
                t0 = time.perf_counter()
                self._run(batch)
                self.seconds += time.perf_counter() - t0
            elif episodes_done():
                return
            else:
                await asyncio.sleep(0.001)

    @torch.no_grad()
    def _run(self, batch: list[_Pending]) -> None:
        g = batch[0].request.gconfig
        if any(p.request.gconfig != g for p in batch):
            raise ValueError("the in-process loop batches requests with one gconfig only")
        rows = [(p, i) for p in batch for i in range(p.request.group_size)]
        prompts = [p.request.prompt_ids for p, _ in rows]
        width = max(len(ids) for ids in prompts)
        input_ids = torch.tensor([[self.pad] * (width - len(ids)) + list(ids) for ids in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=self.device)
        temperature = 1.0 if g.greedy else g.temperature
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=g.max_new_tokens,
            min_new_tokens=g.min_new_tokens or None,
            do_sample=not g.greedy,
            temperature=temperature,
            top_k=g.top_k if g.top_k > 0 else 0,
            top_p=g.top_p,
            pad_token_id=self.pad,
            eos_token_id=sorted(self.stop_ids | set(g.stop_token_ids)),
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # [rows, new tokens, vocab]
        logprobs = torch.log_softmax(logits / temperature, dim=-1).gather(-1, new[:, :, None]).squeeze(-1)
        stops = self.stop_ids | set(g.stop_token_ids)
        answers: dict[int, list] = collections.defaultdict(list)
        for r, (ids, lps) in enumerate(zip(new.tolist(), logprobs.tolist())):
            n, finished = len(ids), False
            for j, t in enumerate(ids):
                if t in stops:
                    n, finished = j + 1, True
                    break
            answers[id(rows[r][0])].append((ids[:n], lps[:n], not finished))
        for pending in batch:
            got = answers[id(pending)]
            v = self.version
            result = GenerationResult(
                qid=pending.request.qid,
                prompt_ids=list(pending.request.prompt_ids),
                output_ids=[a[0] for a in got],
                output_logprobs=[a[1] for a in got],
                output_versions=[[v] * len(a[0]) for a in got],
                no_eos=[a[2] for a in got],
                version_start=[v] * len(got),
                version_end=[v] * len(got),
            )
            if not pending.future.done():
                pending.future.set_result(result)


async def run_episodes(agent, env_factory, prompts: list[PromptRecord], generator: SamplingGenerator) -> list:
    done = 0

    async def episode(prompt):
        nonlocal done
        env = env_factory()
        try:
            return await agent.run_episode(prompt, env, generator)
        finally:
            await env.close()
            done += 1

    tasks = [asyncio.create_task(episode(p)) for p in prompts]
    serve = asyncio.create_task(generator.serve(lambda: done == len(tasks)))
    try:
        results = await asyncio.gather(*tasks)
        await serve
    finally:
        for task in (*tasks, serve):
            task.cancel()
        await asyncio.gather(*tasks, serve, return_exceptions=True)
    return [t for trajectories in results for t in trajectories]


# ---- the data, in the rollout worker's order ---------------------------------------------


class PromptStream:
    """Prompts as rollout worker 0 of 1 offers them: the shard in a per-epoch
    permutation seeded by (seed, 0, epoch); qids `<query_id>@<epoch>`."""

    def __init__(self, path: str, tokenizer, max_prompt_len: int, seed: int, shuffle: bool, dataset_cfg):
        from realrl.impl import datasets

        records = datasets.load_records(path, dataset_cfg)
        self.prompts, _ = datasets.prompt_records(records, tokenizer, dataset_cfg, max_prompt_len)
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.position = 0, 0
        self.order = self._order(0)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng([self.seed, 0, epoch]).permutation(len(self.prompts))

    def next(self) -> PromptRecord:
        if self.position == len(self.order):
            self.epoch, self.position = self.epoch + 1, 0
            self.order = self._order(self.epoch)
        base = self.prompts[int(self.order[self.position])]
        self.position += 1
        return dataclasses.replace(
            base, qid=f"{base.qid}@{self.epoch}", metadata={"query_id": base.qid, "epoch": self.epoch}
        )


# ---- the in-process loop ------------------------------------------------------------------


def greedy_eval(model, tokenizer, cfg, model_path: str, test_records: list[PromptRecord], version: int) -> float:
    """Greedy accuracy exactly as ModelWorker._handle_evaluate computes it."""
    from realrl.impl.evaluation import ModelGenerator, evaluate_prompts

    settings = dataclasses.replace(agent_settings(cfg, model_path), tokenizer=tokenizer)
    eval_tokens = cfg.eval.max_new_tokens or cfg.rollout.gconfig.max_new_tokens
    agent = make_agent(cfg.rollout.agent.type, settings.for_evaluation(eval_tokens), **cfg.rollout.agent.args)
    env = env_config(cfg)
    generator = ModelGenerator(model, tokenizer, model.device, version, batch_size=cfg.eval.batch_size)
    was_training = model.training
    model.eval()
    try:
        results = asyncio.run(evaluate_prompts(agent, lambda: make_env(env.type, **env.args), test_records, generator))
    finally:
        model.train(was_training)
    return sum(o.score >= 1.0 - 1e-6 for o in results) / max(len(results), 1)


def run_inprocess(
    cfg,
    model_path: str,
    train_path: str,
    test_path: str,
    steps: int,
    eval_every: int,
    prox_recompute: bool,
    threads: int | None = None,
    device: str = "cpu",
) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import realrl.impl.agents  # noqa: F401  (registers the built-in agents and environments)
    import realrl.impl.environments  # noqa: F401
    from realrl.impl import datasets
    from realrl.impl.generation.eos import eos_token_ids_in_dir
    from realrl.impl.ppo.batch import SequenceBatch
    from realrl.impl.ppo.trainer import PPOTrainer, optimized_as_configured

    t_start = time.monotonic()
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    load = os.getloadavg()[0]
    if threads > 1 and load > (os.cpu_count() or 1) and "OMP_WAIT_POLICY" not in os.environ:
        print(
            f"vs_inprocess: warning: load average {load:.1f} on {os.cpu_count()} cores: OpenMP threads spin while "
            "they wait, and with other processes on the cores a multi-threaded loop can run many times slower; "
            "--omp-passive or --threads 1 avoid that",
            file=sys.stderr,
        )
    torch.manual_seed(cfg.seed)  # as ModelWorker (seed + worker index 0)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    o, ppo = cfg.optimizer, cfg.ppo
    actor = optimized_as_configured(model, o, steps)  # as the trial's trainer sizes its schedule
    temperature = 0.0 if cfg.rollout.gconfig.greedy else cfg.rollout.gconfig.temperature
    trainer = PPOTrainer(actor, ppo, temperature, torch.device(device), o.gradient_clipping)
    if ppo.adv_estimator != "grpo" or ppo.kl_ctl > 0:
        raise SystemExit("the in-process loop runs GRPO without a reference model (the default)")

    max_prompt_len = min(
        cfg.dataset.max_prompt_len, model.config.max_position_embeddings - cfg.rollout.gconfig.max_new_tokens
    )
    stream = PromptStream(train_path, tokenizer, max_prompt_len, cfg.seed, cfg.dataset.shuffle, cfg.dataset)
    test = datasets.load_records(test_path, cfg.dataset)
    if cfg.eval.max_prompts:
        test = test[: cfg.eval.max_prompts]
    test_records, _ = datasets.prompt_records(test, tokenizer, cfg.dataset)
    for r in test_records:
        r.qid = f"eval-{r.qid}"
    settings = dataclasses.replace(agent_settings(cfg, model_path), tokenizer=tokenizer)
    agent = make_agent(cfg.rollout.agent.type, settings, **cfg.rollout.agent.args)
    env = env_config(cfg)
    stop_ids = set(eos_token_ids_in_dir(model_path, tokenizer))  # as the servers stop

    evals = [{"step": 0, "accuracy": greedy_eval(model, tokenizer, cfg, model_path, test_records, 0), "train_s": 0.0}]
    per_step, train_s = [], 0.0
    B = ppo.train_batch_size
    for step in range(1, steps + 1):
        t0 = time.monotonic()
        generator = SamplingGenerator(model, tokenizer, step - 1, stop_ids)
        trajectories: list = []
        model.eval()
        while len(trajectories) < B:  # an agent may reject a group (success-rate filter): draw more
            prompts = [stream.next() for _ in range(B - len(trajectories))]
            trajectories += asyncio.run(run_episodes(agent, lambda: make_env(env.type, **env.args), prompts, generator))
        model.train()
        t_gen = time.monotonic()
        batch = SequenceBatch.from_trajectories(trajectories)
        if prox_recompute and ppo.use_decoupled_loss:
            trainer.inference(batch, decoupled=True)
        t_inf = time.monotonic()
        stats = trainer.train_step(batch)
        t_train = time.monotonic()
        train_s += t_train - t0
        scores = [s for t in trajectories for s in t.scores]
        per_step.append(
            {
                "step": step,
                "step_s": t_train - t0,
                "generate_s": generator.seconds,
                "episodes_s": t_gen - t0,
                "inference_s": t_inf - t_gen,
                "train_s": t_train - t_inf,
                "completion_tokens": batch.n_completion_tokens(),
                "accuracy": sum(s >= 1.0 - 1e-6 for s in scores) / max(len(scores), 1),
                "reward_mean": stats["reward_mean"],
                "actor_loss": stats["actor_loss"],
            }
        )
        if (eval_every and step % eval_every == 0) or step == steps:
            acc = greedy_eval(model, tokenizer, cfg, model_path, test_records, step)
            evals.append({"step": step, "accuracy": acc, "train_s": train_s})
            print(
                f"in-process: step {step}/{steps} {60 * step / train_s:.1f} steps/min, eval accuracy {acc:.3f}",
                flush=True,
            )
    mean = lambda key: sum(s[key] for s in per_step) / len(per_step)  # noqa: E731
    return {
        "device": device,
        "threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "prox_recompute": bool(prox_recompute and ppo.use_decoupled_loss),
        "steps": steps,
        "train_loop_s": train_s,
        "steps_per_min": 60 * steps / train_s,
        "tokens_per_s": sum(s["completion_tokens"] for s in per_step) / train_s,
        "seconds_per_step": {
            "generate (model.generate)": mean("generate_s"),
            "episodes (generate + decode + reward)": mean("episodes_s"),
            "inference (proximal logprobs)": mean("inference_s"),
            "train": mean("train_s"),
            "step": mean("step_s"),
        },
        "eval_history": evals,
        "accuracy_per_step": [s["accuracy"] for s in per_step],
        "actor_loss_per_step": [s["actor_loss"] for s in per_step],
        "command_wall_s": time.monotonic() - t_start,
    }


# ---- the realrl run ---------------------------------------------------------------------


def run_realrl(cfg) -> dict:
    transport = cfg.weights.transport
    t0 = time.monotonic()
    code, summary_path = run_experiment(cfg)
    wall = time.monotonic() - t0
    if code != 0:
        raise SystemExit(f"the realrl run failed with exit code {code}")
    with open(summary_path) as f:
        summary = json.load(f)
    with open(summary["stats_path"]) as f:
        steps = [s for s in map(json.loads, f) if "train/actor_loss" in s]
    step_s = {s["step"]: s["time/step_s"] for s in steps}
    total = sum(step_s.values())
    mean = lambda key: sum(s.get(key, 0.0) for s in steps) / max(len(steps), 1)  # noqa: E731
    evals = [
        {"step": e["step"], "accuracy": e["accuracy"], "train_s": sum(v for k, v in step_s.items() if k <= e["step"])}
        for e in summary["eval_history"]
    ]
    return {
        "transport": transport,
        "steps": len(steps),
        "train_loop_s": total,
        "steps_per_min": 60 * len(steps) / total,
        "tokens_per_s": sum(s.get("train/completion_tokens", 0.0) for s in steps) / total,
        "seconds_per_step": {
            "fetch (waiting for rollouts)": mean("time/fetch_s"),
            "inference (proximal logprobs)": mean("time/inference_s"),
            "train (+ publish)": mean("time/train_s"),
            "step": mean("time/step_s"),
        },
        "eval_history": evals,
        "accuracy_per_step": [s.get("rollout/accuracy") for s in steps],
        "max_staleness_trained": summary["max_staleness_trained"],
        "command_wall_s": wall,
    }


def time_to_target(evals: list[dict], target: float) -> dict | None:
    hit = next((e for e in evals if e["accuracy"] >= target), None)
    return None if hit is None else {"step": hit["step"], "train_s": hit["train_s"], "accuracy": hit["accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="30 steps, evaluation every 10 (~2-3 min)")
    parser.add_argument("--steps", type=int, default=None, help="train steps on each side (default 200)")
    parser.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (default 20; quick 10)")
    parser.add_argument("--eval-prompts", type=int, default=128, help="greedy eval on the first N test prompts")
    parser.add_argument("--target", type=float, default=0.5, help="eval accuracy for 'time to target'")
    parser.add_argument(
        "--no-prox-recompute",
        action="store_true",
        help="in-process: take the behaviour logprobs as proximal ones (on-policy they are equal)",
    )
    parser.add_argument("--threads", type=int, default=None, help="in-process torch threads (default: all cores)")
    parser.add_argument(
        "--omp-passive",
        action="store_true",
        help="OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep instead of spinning while they wait "
        "(on a machine whose cores are busy with other work, spinning threads can make "
        "2-thread torch ~10x slower than 1 thread)",
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu | cuda: the loop's device, and the realrl run's trainer and server"
    )
    parser.add_argument("--only", choices=["inprocess"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help="a model directory for both sides (default: the tiny kit)")
    parser.add_argument(
        "--transport",
        default=None,
        help="comma-separated weight transports, each a realrl run against the same in-process loop "
        "(e.g. disk,broadcast; default: the config's)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--fileroot", default=os.path.join(_REPO, "runs", "bench"))
    args, overrides = parser.parse_known_args()
    steps = args.steps or (30 if args.quick else 200)
    eval_every = args.eval_every if args.eval_every is not None else (10 if args.quick else 20)
    cache = (
        []
        if any(o.startswith("tiny_kit.cache_dir=") for o in overrides) or not os.path.isdir("/tmp/kit")
        else ["tiny_kit.cache_dir=/tmp/kit"]
    )
    if args.model:
        overrides = [f"model.path={os.path.abspath(args.model)}", *overrides]
        if not any(o.startswith("dataset.train_path=") for o in overrides):
            from realrl.impl.math_data import MathDataRecipe, write_math_dataset

            train, test = write_math_dataset(os.path.join(args.fileroot, "vs-inprocess-data"), MathDataRecipe())
            overrides += [f"dataset.train_path={train}", f"dataset.test_path={test}"]
    transports = args.transport.split(",") if args.transport else [None]

    def config(transport: str | None):
        return load_config(
            [
                "experiment_name=vs-inprocess",
                f"trial_name=realrl-{transport}" if transport else "trial_name=realrl",
                f"fileroot={args.fileroot}",
                f"total_train_steps={steps}",
                f"eval.every_n_steps={eval_every}",
                f"eval.max_prompts={args.eval_prompts}",
                *cache,
                *(
                    [f"train.device={args.device}", f"server.torch.device={args.device}"]
                    if args.device != "cpu"
                    else []
                ),
                *overrides,
                *([f"weights.transport={transport}"] if transport else []),
            ]
        )

    configs = [config(t) for t in transports]  # (a bad transport is a config error before anything runs)
    cfg = configs[0]
    model_path, train_path, test_path = resolve_model_and_data(cfg, os.path.abspath(cfg.fileroot))  # before timing

    runs = [] if args.only == "inprocess" else [run_realrl(c) for c in configs]  # (--only: the loop alone)
    inproc = run_inprocess(
        cfg, model_path, train_path, test_path, steps, eval_every, not args.no_prox_recompute, args.threads, args.device
    )
    if not runs:
        print(json.dumps(inproc, indent=1))
        return
    for r in (*runs, inproc):
        r["time_to_target"] = time_to_target(r["eval_history"], args.target)
    for r in runs:
        r["ratio"] = r["steps_per_min"] / inproc["steps_per_min"]
    realrl, ratio = runs[0], runs[0]["ratio"]
    named = [(f"realrl {r['transport']}" if len(runs) > 1 else "realrl", r) for r in runs]

    print(
        f"\nrealrl vs an in-process synchronous loop of its trainer code: {steps} steps, seed {cfg.seed}, "
        f"{cfg.ppo.train_batch_size} prompts x {cfg.ppo.group_size} answers, {cfg.rollout.gconfig.max_new_tokens} new "
        f"tokens; in-process torch threads {inproc['threads']} of {os.cpu_count()} cores "
        f"(OMP_WAIT_POLICY {inproc['omp_wait_policy']}), proximal logprobs "
        f"{'as the trainer takes them (PPOTrainer.inference)' if inproc['prox_recompute'] else 'taken from behaviour'}"
    )
    print(
        f"{'side':<20}{'steps/min':>10}{'tokens/s':>9}{'train s':>9}{'command s':>10}"
        f"{'to ' + format(args.target, '.2f') + ' (s @ step)':>22}"
        f"  eval accuracy"
    )
    for name, r in (*named, ("in-process", inproc)):
        t = r["time_to_target"]
        reach = f"{t['train_s']:.1f} @ {t['step']}" if t else "not reached"
        curve = " ".join(f"{e['accuracy']:.2f}" for e in r["eval_history"])
        print(
            f"{name:<20}{r['steps_per_min']:>10.1f}{r['tokens_per_s']:>9.1f}{r['train_loop_s']:>9.1f}"
            f"{r['command_wall_s']:>10.1f}"
            f"{reach:>22}  {curve}"
        )
    print(f"eval steps: {' '.join(str(e['step']) for e in realrl['eval_history'])}")
    for name, r in (*named, ("in-process", inproc)):
        print(f"{name} seconds per step: " + ", ".join(f"{k} {v:.3f}" for k, v in r["seconds_per_step"].items()))
    for name, r in named:
        print(f"ratio ({name} steps/min / in-process steps/min): {r['ratio']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "ratio": ratio,
                    "steps": steps,
                    "eval_every": eval_every,
                    "eval_prompts": args.eval_prompts,
                    "target": args.target,
                    "realrl": realrl,
                    "transports": {r["transport"]: r for r in runs},
                    "inprocess": inproc,
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
