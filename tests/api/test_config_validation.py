"""Config checks in the launching process, before anything is created:
`validate` (each value on its own) and `realrl.experiment.checks.check_environment`
(fileroot, plugins, agent/env registries, lengths against the model's
positions). The entry point's own behaviour on a bad value (one line, exit 2,
nothing started) is tested through subprocesses in tests/e2e/test_entry_point.py."""

from __future__ import annotations

import json
import os

import pytest

from realrl.api.cli_args import ConfigError, validate
from realrl.experiment.build import build_experiment
from realrl.experiment.checks import check_environment, check_writable_dir, model_positions
from realrl.experiment.config import agent_config, load_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARD_FILTER_PLUGIN = os.path.join(REPO, "tests", "e2e", "shard_filter_plugin.py")


def config(tmp_path, *overrides: str):
    return load_config([f"fileroot={tmp_path / 'runs'}", *overrides])


def write_model(tmp_path, **config_json) -> str:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", **config_json}))
    return str(model)


def write_train(tmp_path) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"query_id": "q0", "prompt": "1+1=", "answer": "2"}) + "\n")
    return str(path)


def test_the_default_config_is_valid_and_checking_it_creates_nothing(tmp_path):
    cfg = config(tmp_path)
    alloc = validate(cfg)
    assert check_environment(cfg, alloc) == 256  # the tiny model's positions, known without building it
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "override, key",
    [
        ("eval.batch_size=0", "eval.batch_size"),
        ("eval.max_new_tokens=-1", "eval.max_new_tokens"),
        ("eval.max_prompts=-1", "eval.max_prompts"),
        ("server.torch.max_running_requests=0", "server.torch.max_running_requests"),
        ("server.torch.dtype=int8", "server.torch.dtype"),
        ("server.torch.engine=vllm", "server.torch.engine"),
        ("server.torch.kv_cache_tokens=8", "server.torch.kv_cache_tokens"),
        ("server.startup_timeout=0", "server.startup_timeout"),
        ("server.weight_update_timeout=0", "server.weight_update_timeout"),
        ("server.weight_update_retries=-1", "server.weight_update_retries"),
        ("server.sglang.mem_fraction_static=0", "server.sglang.mem_fraction_static"),
        ("server.sglang.mem_fraction_static=1.01", "server.sglang.mem_fraction_static"),
        ("server.sglang.dtype=int4", "server.sglang.dtype"),
        ("server.sglang.context_length=0", "server.sglang.context_length"),
        ("server.sglang.max_running_requests=0", "server.sglang.max_running_requests"),
        ("server.sglang.log_level=loud", "server.sglang.log_level"),
        ("rollout.request_retries=-1", "rollout.request_retries"),
        ("rollout.request_timeout=-5", "rollout.request_timeout"),
        ("rollout.gconfig.top_p=2", "rollout.gconfig.top_p"),
        ("optimizer.warmup_steps=-1", "optimizer.warmup_steps"),
        ("optimizer.weight_decay=-1", "optimizer.weight_decay"),
        ("optimizer.beta1=-0.1", "optimizer.beta1"),
        ("optimizer.beta2=1", "optimizer.beta2"),
        ("optimizer.eps=-1e-8", "optimizer.eps"),
        ("optimizer.lr_scheduler=step", "optimizer.lr_scheduler"),
        ("optimizer.min_lr_ratio=1.5", "optimizer.min_lr_ratio"),
        ("ppo.value_eps_clip=0", "ppo.value_eps_clip"),
        ("ppo.kl_estimator=k9", "ppo.kl_estimator"),
        ("allocation_mode=torch.d1p2m1+d1p1m1", "allocation_mode"),
        ("name_resolve.type=zookeeper", "name_resolve.type"),
        ("console.every_n_steps=0", "console.every_n_steps"),
        ("model.lora.rank=-1", "model.lora.rank"),
        ("model.lora.alpha=0", "model.lora.alpha"),
        ("model.lora.dropout=1", "model.lora.dropout"),
        ("model.lora.target_modules=[]", "model.lora.target_modules"),
        ("model.lora.target_modules=[all-linear,q_proj]", "model.lora.target_modules"),
        ("model.lora.target_modules=['q proj']", "model.lora.target_modules"),
        ("weights.transport=wire", "weights.transport"),
        ("weights.backend=mpi", "weights.backend"),
        ("weights.bucket_mb=0", "weights.bucket_mb"),
        ("weights.auto_broadcast_mb=-1", "weights.auto_broadcast_mb"),
        ("weights.backend=nccl", "weights.backend"),  # (on cpu)
    ],
)
def test_validate_names_the_key_first(tmp_path, override, key):
    with pytest.raises(ConfigError, match=f"^{key}: ") as e:
        validate(config(tmp_path, override))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["allocation_mode=vllm.d1p1m1+d1p1m1"], "broadcast is not wired for vLLM servers yet"),
        (["server.torch.emulate_vllm=0.33.0"], "broadcast is not wired for vLLM servers yet"),
        (["model.lora.rank=4"], "broadcast moves full weights; LoRA adapters go on disk"),
    ],
)
def test_broadcast_weights_where_they_cannot_go_is_a_config_error(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=f"^weights.transport: {message}"):
        validate(config(tmp_path, "weights.transport=broadcast", *overrides))
    validate(config(tmp_path, "weights.transport=broadcast", "weights.bucket_mb=8"))
    validate(config(tmp_path, "weights.transport=broadcast", "allocation_mode=sglang.d1p1m1+d1p1m1"))


def test_weights_transport_auto_broadcasts_versions_of_the_measured_size_up(tmp_path):
    """auto (the default): broadcast where the trial can take it and a
    version's weights are at least `weights.auto_broadcast_mb`, else disk;
    a version's bytes are the parameters the model's safetensors hold (tied
    ones once), counted from their headers, in `model.dtype`. The trainer
    and the manager get the one decision."""
    from realrl.experiment.build import version_weight_bytes, weights_transport
    from realrl.impl.weights.broadcast import published_tensors
    from tests.impl.weights.models import tiny_model

    model = tiny_model("tied", seed=1)
    path = str(tmp_path / "model")
    model.save_pretrained(path)
    params = sum(t.numel() for t in published_tensors(model).values())
    assert params < sum(p.numel() for p in model.state_dict().values())  # (the tied pair once)
    assert version_weight_bytes(path, "float32") == 4 * params
    assert version_weight_bytes(path, "bfloat16") == 2 * params
    base = [f"model.path={path}", f"dataset.train_path={write_train(tmp_path)}"]

    def transport(*overrides: str) -> str:
        groups = {g.worker_type: g for g in build_experiment(config(tmp_path, *base, *overrides)).groups}
        chosen = {groups[w].config.weights.transport for w in ("model_worker", "gserver_manager")}
        assert len(chosen) == 1, chosen
        return chosen.pop()

    assert load_config([]).weights.transport == "auto"
    assert transport() == "disk"  # a tiny model: below the measured crossover
    assert transport("weights.auto_broadcast_mb=0") == "broadcast"
    assert transport("weights.auto_broadcast_mb=0", "weights.transport=disk") == "disk"
    # Where broadcast cannot go, auto is disk (asked for by name, it is a config error: above).
    assert transport("weights.auto_broadcast_mb=0", "model.lora.rank=4") == "disk"
    assert transport("weights.auto_broadcast_mb=0", "server.torch.emulate_vllm=0.33") == "disk"
    # Over NCCL (trainer and servers on cuda) broadcast is not measured yet: auto is disk there.
    cfg = config(tmp_path, *base, "weights.auto_broadcast_mb=0")
    assert [weights_transport(cfg, validate(cfg), path, backend) for backend in ("gloo", "nccl")] == [
        "broadcast",
        "disk",
    ]
    assert not (tmp_path / "runs").exists()


def test_sglang_sampling_logprobs_need_a_top_k_it_can_bound(tmp_path):
    """SGLang reports sampling logprobs (`return_sampling_mask`) only for a
    top_k it can bound, and refuses the others with HTTP 400: 0.5.16 any
    finite top_k, 0.5.23 top_k <= --sampling-mask-max-tokens (4096). The
    release checked is the installed one (none here: the newest read, 0.5.23)
    or the emulated one; a refused gconfig is one line before anything starts."""
    sglang = "allocation_mode=sglang.d1p1m1+d1p1m1"
    emulated = {v: f"server.torch.emulate_sglang={v}" for v in ("0.5.16", "0.5.23")}
    for backend in (sglang, emulated["0.5.16"], emulated["0.5.23"]):
        with pytest.raises(ConfigError, match=r"^rollout.gconfig: SGLang 0\.5\.(16|23) refuses") as e:
            validate(config(tmp_path, backend, "rollout.gconfig.top_p=0.9"))
        assert "\n" not in str(e.value) and "top_k" in str(e.value)
        validate(config(tmp_path, backend, "rollout.gconfig.top_p=0.9", "rollout.gconfig.top_k=100"))
        validate(config(tmp_path, backend, "rollout.gconfig.top_p=1.0"))
        validate(config(tmp_path, backend, "rollout.gconfig.top_p=0.9", "rollout.gconfig.greedy=true"))
    big_k = ("rollout.gconfig.top_p=0.9", "rollout.gconfig.top_k=5000")
    validate(config(tmp_path, emulated["0.5.16"], *big_k))
    for backend in (sglang, emulated["0.5.23"]):
        with pytest.raises(ConfigError, match=r"1 < top_k <= 4096; got top_k=5000"):
            validate(config(tmp_path, backend, *big_k))
    validate(config(tmp_path, sglang, *big_k, "server.sglang.extra_args=[--sampling-mask-max-tokens,8192]"))
    validate(config(tmp_path, "rollout.gconfig.top_p=0.9"))  # the torch server always reports them


def test_what_vllm_cannot_serve_is_a_config_error(tmp_path):
    """vLLM reports one logprob per token: filtered sampling cannot be
    trained on there (one line naming the keys); LoRA ranks above 512 do not
    fit --max-lora-rank; the emulated release must be one realrl runs with."""
    for backend in ("allocation_mode=vllm.d1p1m1+d1p1m1", "server.torch.emulate_vllm=0.33"):
        for filtered in ("rollout.gconfig.top_p=0.9", "rollout.gconfig.top_k=50"):
            with pytest.raises(ConfigError, match=r"^rollout.gconfig: vLLM reports one logprob per token") as e:
                validate(config(tmp_path, backend, filtered))
            assert "\n" not in str(e.value) and filtered.split(".")[-1].split("=")[0] in str(e.value)
        validate(config(tmp_path, backend, "rollout.gconfig.top_p=0.9", "rollout.gconfig.greedy=true"))
    with pytest.raises(ConfigError, match=r"^model.lora.rank: vLLM serves LoRA ranks up to 512"):
        validate(config(tmp_path, "allocation_mode=vllm.d1p1m1+d1p1m1", "model.lora.rank=600"))
    with pytest.raises(ConfigError, match=r"^server.torch.emulate_vllm: 0.31 is older than 0.32"):
        validate(config(tmp_path, "server.torch.emulate_vllm=0.31"))


def test_agent_calls_the_backend_cannot_serve_are_refused(tmp_path):
    """An agent's own sampling (a per-call gconfig, an OpenAI-style call's
    top_p) is checked as the run's is, per release: a `SamplingRefused`
    (HTTP 400 at the endpoint) before anything is sent."""
    import asyncio

    from realrl.api.agent_api import _EPISODE, Agent, _Episode
    from realrl.api.generation_api import GenerationHyperparameters
    from realrl.api.served_sampling import SamplingRefused
    from realrl.experiment.config import agent_settings

    class Probe(Agent):
        async def collect_trajectory(self, prompt, env):
            return []

    class Sent:
        requests: list = []

        async def generate(self, request):
            self.requests.append(request)
            raise RuntimeError("sent")

    async def call(cfg, **gconfig):
        agent = Probe(agent_settings(cfg, "/m"))
        _EPISODE.set(_Episode("q", Sent()))
        await agent.generate([1, 2], gconfig=GenerationHyperparameters(**gconfig))

    new = config(tmp_path, "server.torch.emulate_sglang=0.5.23")
    for gconfig in ({"top_p": 0.9}, {"top_p": 0.9, "top_k": 5000}):
        with pytest.raises(SamplingRefused, match="SGLang 0.5.23 refuses") as e:
            asyncio.run(call(new, **gconfig))
        assert e.value.status == 400
    with pytest.raises(RuntimeError, match="sent"):  # served: it reaches the generator
        asyncio.run(call(new, top_p=0.9, top_k=100))
    with pytest.raises(RuntimeError, match="sent"):
        asyncio.run(call(config(tmp_path, "server.torch.emulate_sglang=0.5.16"), top_p=0.9, top_k=5000))
    with pytest.raises(RuntimeError, match="sent"):
        asyncio.run(call(config(tmp_path), top_p=0.9))  # the torch server
    with pytest.raises(SamplingRefused, match="vLLM reports one logprob per token"):
        asyncio.run(call(config(tmp_path, "server.torch.emulate_vllm=0.33"), top_p=0.9, top_k=100))


@pytest.mark.parametrize("value", ["1", "0.5", "1.0"])
def test_valid_edges_pass(tmp_path, value):
    validate(config(tmp_path, f"server.sglang.mem_fraction_static={value}", "optimizer.beta1=0", "eval.max_prompts=0"))


def test_an_agent_registered_by_a_plugin_is_accepted(tmp_path):
    cfg = config(tmp_path, f"plugins=[{SHARD_FILTER_PLUGIN}]", "rollout.agent.type=shard-filter-agent")
    assert check_environment(cfg, validate(cfg)) == 256


def test_lora_target_modules_must_be_layers_of_the_model(tmp_path):
    """Checked on an empty (meta) copy of the architecture: the tiny kit's
    Llama, or model.path's config."""
    cfg = config(tmp_path, "model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]")
    check_environment(cfg, validate(cfg))
    cfg = config(tmp_path, "model.lora.rank=8", "model.lora.target_modules=[c_attn]")
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules: .*no linear layer named \['c_attn'\]"):
        check_environment(cfg, validate(cfg))
    model = write_model(
        tmp_path,
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        max_position_embeddings=64,
    )
    cfg = config(
        tmp_path,
        f"model.path={model}",
        f"dataset.train_path={write_train(tmp_path)}",
        "model.lora.rank=4",
        "model.lora.target_modules=[gate_proj,qkv_proj]",
        "rollout.gconfig.max_new_tokens=8",
    )
    with pytest.raises(
        ConfigError, match=r"^model.lora.target_modules: .*\['qkv_proj'\]; its linear layers: .*gate_proj"
    ):
        check_environment(cfg, validate(cfg))
    assert sorted(os.listdir(tmp_path)) == ["model", "train.jsonl"]  # nothing created


def test_unknown_types_list_what_is_registered(tmp_path):
    cfg = config(tmp_path, "rollout.agent.type=nosuch")
    with pytest.raises(
        ConfigError, match=r"^rollout.agent.type: unknown agent 'nosuch'; registered: .*math-single-step"
    ):
        check_environment(cfg, validate(cfg))
    cfg = config(tmp_path, "rollout.env.type=nosuch")
    with pytest.raises(ConfigError, match=r"^rollout.env.type: unknown environment 'nosuch'; registered: math"):
        check_environment(cfg, validate(cfg))


USER_AGENTS = """
from realrl.api.agent_api import Agent


class MyAgent(Agent):
    async def collect_trajectory(self, prompt, env):
        return []


async def run(client, row):
    return 1.0


def not_async(client, row):
    return 1.0
"""


def test_an_agent_class_or_function_of_a_users_file_needs_no_registering(tmp_path, monkeypatch):
    (tmp_path / "agents.py").write_text(USER_AGENTS)
    monkeypatch.chdir(tmp_path)  # relative paths work, and reach the workers absolute
    for override, agent_type, args in (
        ("rollout.agent.type=agents.py:MyAgent", f"{tmp_path}/agents.py:MyAgent", {}),
        ("rollout.agent_fn=agents.py:run", "function", {"fn": f"{tmp_path}/agents.py:run"}),
    ):
        cfg = config(tmp_path, override)
        assert check_environment(cfg, validate(cfg)) == 256
        agent = agent_config(cfg)  # what the rollout workers and the evaluation get
        assert (agent.type, agent.args) == (agent_type, args)


@pytest.mark.parametrize(
    "override, key, message",
    [
        ("rollout.agent.type=agents.py:Nope", "rollout.agent.type", "has no attribute 'Nope'"),
        ("rollout.agent_fn=agents.py:not_async", "rollout.agent_fn", "is not an async function"),
        ("rollout.agent_fn=missing.py:run", "rollout.agent_fn", "does not exist"),
    ],
)
def test_a_bad_agent_of_a_users_file_is_a_config_error(tmp_path, monkeypatch, override, key, message):
    (tmp_path / "agents.py").write_text(USER_AGENTS)
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path, override)
    with pytest.raises(ConfigError, match=f"^{key}: ") as e:
        check_environment(cfg, validate(cfg))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_agent_function_replaces_the_agent(tmp_path):
    cfg = config(tmp_path, "rollout.agent_fn=agents.py:run", "rollout.agent.type=math-multi-turn")
    with pytest.raises(ConfigError, match="^rollout.agent_fn: replaces the agent"):
        validate(cfg)


def test_a_plugin_that_fails_to_import_is_a_plugins_error(tmp_path):
    plugin = tmp_path / "broken.py"
    plugin.write_text("import no_such_module_for_realrl_tests\n")
    cfg = config(tmp_path, f"plugins=[{plugin}]")
    with pytest.raises(ConfigError, match="^plugins: .*no_such_module_for_realrl_tests"):
        check_environment(cfg, validate(cfg))


def test_writable_dir_check_creates_nothing(tmp_path):
    check_writable_dir(str(tmp_path / "a" / "b" / "c"), "fileroot")  # creatable: fine
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path / "file", tmp_path / "file" / "sub", "/proc/realrl-test"):
        with pytest.raises(ConfigError, match="^fileroot: "):
            check_writable_dir(str(bad), "fileroot")
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_model_positions_come_from_config_json(tmp_path):
    cfg = config(tmp_path, f"model.path={write_model(tmp_path, max_position_embeddings=64)}")
    assert model_positions(cfg) == 64
    (tmp_path / "model" / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 32}, "max_position_embeddings": 4096})
    )
    assert model_positions(cfg) == 32  # the decoder's own config, as the torch server reads it
    (tmp_path / "model" / "config.json").write_text(json.dumps({"n_positions": 1024}))
    assert model_positions(cfg) == 1024
    (tmp_path / "model" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="^model.path: cannot read"):
        model_positions(cfg)


def test_new_tokens_must_leave_room_for_a_prompt(tmp_path):
    model, train = write_model(tmp_path, max_position_embeddings=64), write_train(tmp_path)
    base = [f"model.path={model}", f"dataset.train_path={train}"]
    cfg = config(tmp_path, *base, "rollout.gconfig.max_new_tokens=63")
    assert check_environment(cfg, validate(cfg)) == 64
    cfg = config(tmp_path, *base, "rollout.gconfig.max_new_tokens=64")
    with pytest.raises(ConfigError, match="^rollout.gconfig.max_new_tokens: must be < 64"):
        check_environment(cfg, validate(cfg))
    cfg = config(tmp_path, *base, "eval.max_new_tokens=64")
    with pytest.raises(ConfigError, match="^eval.max_new_tokens: must be < 64"):
        check_environment(cfg, validate(cfg))


def test_prompts_that_leave_no_room_for_new_tokens_are_skipped(tmp_path):
    """max_prompt_len + max_new_tokens beyond the positions is not an error (the
    default, 256 + 8 with a 256-position model, is like that and its prompts are
    short): the rollout workers skip the prompts the server would refuse."""
    model, train = write_model(tmp_path, max_position_embeddings=64), write_train(tmp_path)
    base = [f"model.path={model}", f"dataset.train_path={train}", "rollout.gconfig.max_new_tokens=16"]
    groups = {g.worker_type: g for g in build_experiment(config(tmp_path, *base)).groups}
    assert groups["rollout_worker"].config.max_prompt_len == 64 - 16
    groups = {g.worker_type: g for g in build_experiment(config(tmp_path, *base, "dataset.max_prompt_len=20")).groups}
    assert groups["rollout_worker"].config.max_prompt_len == 20
    assert not (tmp_path / "runs").exists()


def test_episode_priorities_and_the_trial_budget_follow_the_trainer_batch(tmp_path):
    """Each rollout worker gives one trainer batch's share of its episodes one priority
    (docs/design.md §6), and the manager admits no rollout past the last step's batch (§7)."""
    model, train = write_model(tmp_path, max_position_embeddings=64), write_train(tmp_path)
    base = [f"model.path={model}", f"dataset.train_path={train}", "ppo.train_batch_size=10", "total_train_steps=7"]

    def built(*overrides: str) -> tuple[int, int]:
        groups = {g.worker_type: g for g in build_experiment(config(tmp_path, *base, *overrides)).groups}
        return groups["rollout_worker"].config.episodes_per_priority, groups["gserver_manager"].config.total_train_steps

    assert built() == (10, 7)
    assert built("rollout.n_workers=3") == (4, 7)  # ceil(10 / 3)


def test_every_worker_speaks_the_api_of_the_policys_servers_and_the_judge_its_own(tmp_path):
    """Emulating vLLM, the policy's servers, their manager and the rollout
    workers speak vLLM's API; a judge's servers stay on SGLang's, which the
    judge's client speaks (and stay frozen)."""
    from realrl.experiment.build import judge_groups

    model, train = write_model(tmp_path, max_position_embeddings=64), write_train(tmp_path)
    base = [f"model.path={model}", f"dataset.train_path={train}", "server.torch.emulate_vllm=0.33"]
    groups = {g.worker_type: g for g in build_experiment(config(tmp_path, *base)).groups}
    apis = {name: groups[name].config.server_api for name in ("generation_server", "gserver_manager", "rollout_worker")}
    assert apis == dict.fromkeys(apis, "vllm")
    (judge,) = judge_groups(
        config(tmp_path, *base, f"judge.model.path={model}"), groups["generation_server"].config, {}
    )
    assert judge.config.judge and judge.config.server_api == "sglang"


def test_sglang_missing_is_an_allocation_mode_error(tmp_path):
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    cfg = config(tmp_path, "allocation_mode=sglang.d1p1m1+d1p1m1")
    with pytest.raises(ConfigError, match="^allocation_mode: .*sglang"):
        check_environment(cfg, validate(cfg))


def test_trainer_threads_auto_takes_the_cores_generation_leaves(tmp_path):
    model, train = write_model(tmp_path, max_position_embeddings=64), write_train(tmp_path)
    base = [f"model.path={model}", f"dataset.train_path={train}"]
    cores = len(os.sched_getaffinity(0))

    def trainer(*overrides):
        groups = {g.worker_type: g for g in build_experiment(config(tmp_path, *base, *overrides)).groups}
        group = groups["model_worker"]
        assert group.env["OMP_NUM_THREADS"] == str(group.config.num_threads)  # one pool size for both
        return group.config.num_threads, group.config.max_threads

    # One generation server on one CPU thread; while cores are idle, up to all of them.
    assert trainer() == (max(1, cores - 1), cores)
    assert trainer("server.torch.num_threads=64") == (1, cores)  # never below one
    assert trainer("train.num_threads=3") == (3, 3)  # an explicit count wins, and stays
    dp2 = trainer("allocation_mode=torch.d1p1m1+d2p1m1", "ppo.train_batch_size=2")
    assert dp2 == (max(1, (cores - 1) // 2), max(1, (cores - 1) // 2, cores // 2))


def test_server_threads_auto_follow_up_to_an_even_share_of_the_cores(tmp_path):
    from realrl.impl.generation.backends import TorchBackend

    model, train = write_model(tmp_path, max_position_embeddings=64), write_train(tmp_path)
    base = [f"model.path={model}", f"dataset.train_path={train}"]
    cores = len(os.sched_getaffinity(0))

    def server(*overrides):
        groups = {g.worker_type: g for g in build_experiment(config(tmp_path, *base, *overrides)).groups}
        torch_cfg = groups["generation_server"].config.torch
        cmd = TorchBackend().command(groups["generation_server"].config, "127.0.0.1", 1)
        following = cmd[cmd.index("--max-threads") + 1] if "--max-threads" in cmd else None
        return torch_cfg.max_threads, following

    # One server: up to every core while the rest of the machine leaves them idle.
    assert server() == (cores, str(cores) if cores > 1 else None)
    dp2 = server("allocation_mode=torch.d2p1m1+d1p1m1", "ppo.train_batch_size=2")
    assert dp2[0] == max(1, cores // 2)
    assert server("server.torch.max_threads=1") == (1, None)  # a fixed count: nothing follows
    assert server("server.torch.num_threads=3", "server.torch.max_threads=2") == (3, None)  # never below num_threads
    with pytest.raises(ConfigError, match="^server.torch.max_threads: "):
        validate(config(tmp_path, *base, "server.torch.max_threads=-1"))


def test_dataset_files_rows_and_attention_are_checked_before_start(tmp_path):
    """A dataset the workers could not read, a row without the configured key,
    and attention the torch server cannot serve: one line naming the key."""
    model = write_model(tmp_path, max_position_embeddings=64)
    train = write_train(tmp_path)
    base = [f"model.path={model}", f"dataset.train_path={train}"]
    cfg = config(tmp_path, *base, "dataset.prompt_key=question")
    with pytest.raises(ConfigError, match=r"^dataset.train_path: .*train.jsonl: row 1: prompt key 'question' missing"):
        check_environment(cfg, validate(cfg))
    (tmp_path / "test.parquet").write_bytes(b"PAR1 not really")
    cfg = config(tmp_path, *base, f"dataset.test_path={tmp_path / 'test.parquet'}")
    with pytest.raises(ConfigError, match=r"^dataset.test_path: .*test.parquet: not a readable Parquet file"):
        check_environment(cfg, validate(cfg))
    (tmp_path / "model" / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama4_text",
                "architectures": ["Llama4ForCausalLM"],
                "attention_chunk_size": 64,
                "max_position_embeddings": 64,
            }
        )
    )
    cfg = config(tmp_path, *base)
    with pytest.raises(ConfigError, match=r"^model.path: Llama4ForCausalLM: .*chunked"):
        check_environment(cfg, validate(cfg))


@pytest.mark.parametrize(
    "override, message",
    [
        ("ppo.grup_size=4", "ppo.grup_size: unknown key; did you mean ppo.group_size?"),
        (
            "rollout.gconfig.max_new_token=3",
            "rollout.gconfig.max_new_token: unknown key; did you mean rollout.gconfig.max_new_tokens?",
        ),
        ("modle.path=x", "modle.path: unknown key; did you mean model.path?"),
        ("ppo.zzzzqq=1", "ppo.zzzzqq: unknown key; `realrl config` lists the keys"),
    ],
)
def test_an_unknown_key_suggests_the_nearest_known_one(override, message):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    assert str(e.value) == message


def test_an_unknown_key_in_a_config_file_suggests_the_nearest_too(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - async-ppo\n  - _self_\nppo:\n  train_bach_size: 8\n")
    with pytest.raises(ConfigError, match=r"^ppo.train_bach_size: unknown key; did you mean ppo.train_batch_size\?$"):
        load_config([], config_name="mine", config_dir=str(tmp_path))


def test_a_missing_prompt_key_lists_the_rows_fields(tmp_path):
    model = write_model(tmp_path, max_position_embeddings=64)
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "1+1=", "extra": {"level": 1}, "answer": "2"}) + "\n")
    cfg = config(tmp_path, f"model.path={model}", f"dataset.train_path={train}")
    with pytest.raises(ConfigError) as e:
        check_environment(cfg, validate(cfg))
    assert str(e.value).startswith("dataset.train_path: ") and "\n" not in str(e.value)
    assert str(e.value).endswith(
        "prompt key 'prompt' missing and no 'messages' (dataset.prompt_key); "
        "the row's fields: question, extra.level, answer"
    )


def test_a_model_path_that_does_not_exist_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config(tmp_path, "model.path=models/mine")
    with pytest.raises(ConfigError) as e:
        check_environment(cfg, validate(cfg))
    assert str(e.value) == (
        f"model.path: 'models/mine' does not exist, relative to the working directory {tmp_path} "
        "(a Hugging Face model directory)"
    )
    assert not (tmp_path / "runs").exists()  # before anything is created
