"""Built-in agents and the math environment, driven the way the rollout worker
drives them: `agent.run_episode` with a generator in the rollout worker's role
that answers each GenerationRequest with answers encoded by the real character
tokenizer (loaded from disk with AutoTokenizer), and the real math env."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

import realrl.impl.agents  # noqa: F401  (registers the built-ins)
import realrl.impl.environments  # noqa: F401
from realrl.api.agent_api import AgentSettings, PromptRecord, make_agent
from realrl.api.env_api import make_env
from realrl.api.generation_api import GenerationRequest, GenerationResult
from realrl.api.trajectory import Trajectory
from realrl.impl.agents.math_multi_turn import DEFAULT_FEEDBACK
from realrl.impl.ppo.functional import shape_reward
from realrl.impl.tiny_model import build_char_tokenizer
from realrl.impl.verifiers.math_verifier import TEST_HOOK_SLEEP, MathVerifier

PROMPT = "Q: 23+58=?\nA:"


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("char_tokenizer"))
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path)


def record(tokenizer, prompt: str = PROMPT, answer: str = "81", qid: str = "q-1") -> PromptRecord:
    return PromptRecord(
        qid=qid, prompt=prompt, prompt_ids=tokenizer.encode(prompt, add_special_tokens=False), solutions=[answer]
    )


def generation_result(tokenizer, request: GenerationRequest, texts: list[str], truncated=()) -> GenerationResult:
    """What the rollout worker would send back: answer i = texts[i] + eos (none if
    i is in `truncated`), logprobs -0.1*(j+1), versions 3..3,4 (changed mid-answer)."""
    assert len(texts) == request.group_size
    outputs = [
        tokenizer.encode(t, add_special_tokens=False) + ([] if i in truncated else [tokenizer.eos_token_id])
        for i, t in enumerate(texts)
    ]
    return GenerationResult(
        qid=request.qid,
        prompt_ids=list(request.prompt_ids),
        output_ids=outputs,
        output_logprobs=[[-0.1 * (j + 1) for j in range(len(o))] for o in outputs],
        output_versions=[[3] * (len(o) - 1) + [4] for o in outputs],
        no_eos=[i in truncated for i in range(len(texts))],
        version_start=[3] * len(texts),
        version_end=[4] * len(texts),
    )


class ScriptedGenerator:
    """Answers each request with `answer(request)` after yielding once (so
    concurrent requests really overlap); records requests and peak concurrency."""

    def __init__(self, answer: Callable[[GenerationRequest], GenerationResult]):
        self.answer = answer
        self.requests: list[GenerationRequest] = []
        self.in_flight = self.max_in_flight = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return self.answer(request)


def run_episode(agent, env, prompt: PromptRecord, answer: Callable[[GenerationRequest], GenerationResult]):
    """Runs one episode as the rollout worker does. Returns (trajectories, requests seen)."""
    generator = ScriptedGenerator(answer)
    return asyncio.run(agent.run_episode(prompt, env, generator)), generator.requests


def agent(name: str, tokenizer_path: str, own: dict | None = None, **settings):
    return make_agent(name, AgentSettings(tokenizer_path=tokenizer_path, **settings), **(own or {}))


# ---------------------------------------------------------------- math env


def test_math_env_scores_a_group_and_needs_reset(tokenizer):
    async def main():
        env = make_env("math", timeout_s=2.0)
        with pytest.raises(RuntimeError, match="reset"):
            await env.step(["81"])
        await env.reset(options={"prompt": record(tokenizer)})
        return await env.step(["81", "80", "garbage", "The answer is 81.0", ""])

    obs, rewards, terminated, truncated, info = asyncio.run(main())
    assert rewards == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert obs is None and terminated and not truncated
    assert info == {"n_correct": 2, "n_answers": 5}


def test_math_env_latex_answers_and_time_limited_checks():
    verifier = MathVerifier(n_procs=2, test_hooks=True)

    async def main():
        env = make_env("math", timeout_s=2.0, verifier=verifier)
        await env.reset(options={"solutions": [r"\frac{1}{2}"]})
        _, latex_rewards, *_ = await env.step([r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{3}}", "0.5", "zzz"])
        # The hook solution makes the child hang on every check: both checks
        # (run concurrently, one per child) are cut off and score 0.
        hanging = make_env("math", timeout_s=1.0, verifier=verifier)
        await hanging.reset(options={"solutions": [TEST_HOOK_SLEEP]})
        _, hung_rewards, *_ = await hanging.step([r"\boxed{1}", r"\boxed{2}"])
        return latex_rewards, hung_rewards

    try:
        latex_rewards, hung_rewards = asyncio.run(main())
        assert latex_rewards == [1.0, 0.0, 1.0, 0.0]
        assert hung_rewards == [0.0, 0.0] and verifier.n_timeouts == 2
    finally:
        verifier.close()


# ---------------------------------------------------------------- single-step agent


def test_single_step_trajectory_schema_and_reward_shaping(tokenizer, tokenizer_path):
    agent_ = agent(
        "single-step",
        tokenizer_path,
        group_size=4,
        gconfig={"max_new_tokens": 8, "temperature": 0.7},
        reward_bias=0.2,
        reward_scaling=2.0,
    )
    prompt = record(tokenizer)
    texts = ["81", "81.0", "7", "hello"]
    trajs, requests = run_episode(
        agent_, make_env("math"), prompt, lambda req: generation_result(tokenizer, req, texts, truncated={3})
    )

    assert len(requests) == 1
    assert requests[0].prompt_ids == prompt.prompt_ids and requests[0].group_size == 4
    assert requests[0].gconfig.max_new_tokens == 8 and requests[0].gconfig.temperature == 0.7
    (traj,) = trajs
    traj.validate()
    assert traj.qid == "q-1" and traj.task == "math" and traj.group_size == 4
    plen = len(prompt.prompt_ids)
    assert traj.prompt_len == [plen] * 4
    for i, text in enumerate(texts):
        ids = traj.input_ids[i]
        assert ids.dtype == np.int32
        assert ids[:plen].tolist() == prompt.prompt_ids
        eos = [] if i == 3 else [tokenizer.eos_token_id]
        assert traj.completion_ids(i).tolist() == tokenizer.encode(text, add_special_tokens=False) + eos
        n_gen = len(ids) - plen
        assert np.allclose(traj.logprobs[i], [-0.1 * (j + 1) for j in range(n_gen)])
        assert traj.versions[i].tolist() == [3] * (n_gen - 1) + [4]
    assert traj.version_start == [3] * 4 and traj.version_end == [4] * 4
    assert traj.no_eos == [False, False, False, True]
    # ((r - 0.5) * 2 - 0.2) * 2: right 1.6, wrong -2.4
    assert traj.reward == pytest.approx([1.6, 1.6, -2.4, -2.4])
    assert traj.reward == pytest.approx([shape_reward(r, 0.2, 2.0) for r in (1, 1, 0, 0)])
    assert traj.scores == [1.0, 1.0, 0.0, 0.0]
    assert traj.metadata["answers"] == texts
    assert traj.metadata["accuracy"] == 0.5
    assert agent_.pop_stats() == {
        "n_episodes": 1.0,
        "n_rejected": 0.0,
        "n_answers": 4.0,
        "accuracy": 0.5,
        "mean_score": 0.5,
        "env/n_correct": 2.0,
        "env/n_answers": 4.0,
    }

    # The trajectory survives the stream's wire format (metadata included).
    wire = pytest.importorskip("realrl.base.wire")
    back = Trajectory.from_wire(wire.loads(wire.dumps(traj.to_wire())))
    assert back.metadata == traj.metadata and back.reward == pytest.approx(traj.reward) and back.scores == traj.scores


@pytest.mark.parametrize(
    "lb, ub, texts, kept",
    [
        (0.0, 1.0, ["81"] * 4, True),  # defaults keep everything
        (0.0, 1.0, ["1"] * 4, True),
        (0.0, 0.9, ["81"] * 4, False),  # ub < 1 drops the all-correct group
        (0.0, 0.9, ["81", "81", "81", "1"], True),
        (0.1, 1.0, ["1"] * 4, False),  # lb > 0 drops the all-wrong group
        (0.1, 1.0, ["1", "1", "1", "81"], True),
        (0.5, 0.5, ["81", "1", "1", "1"], False),  # 0.25 < lb
        (0.5, 0.5, ["81", "81", "1", "1"], True),
    ],
)
def test_success_rate_filter(tokenizer, tokenizer_path, lb, ub, texts, kept):
    agent_ = agent("single-step", tokenizer_path, group_size=4, success_rate_lb=lb, success_rate_ub=ub)
    trajs, _ = run_episode(
        agent_, make_env("math"), record(tokenizer), lambda req: generation_result(tokenizer, req, texts)
    )
    assert (len(trajs) == 1) == kept
    stats = agent_.pop_stats()
    assert stats["n_rejected"] == (0.0 if kept else 1.0)
    assert stats["accuracy"] == texts.count("81") / 4


def test_agent_config_errors(tokenizer_path):
    with pytest.raises(ValueError, match="success_rate"):
        AgentSettings(tokenizer_path=tokenizer_path, success_rate_lb=0.8, success_rate_ub=0.2)
    with pytest.raises(ValueError, match="unknown gconfig keys"):
        AgentSettings(tokenizer_path=tokenizer_path, gconfig={"max_tokens": 8})
    with pytest.raises(ValueError, match="tokenizer"):
        make_agent("math-multi-turn")  # it encodes its feedback at construction
    with pytest.raises(TypeError):
        agent("single-step", tokenizer_path, own={"no_such_option": 1})


def test_partial_credit_passes_through_and_evaluation_keeps_everything(tokenizer, tokenizer_path):
    """A float score is not rounded to right/wrong: it becomes the reward by
    the affine shaping, and only full credit counts as correct."""
    from realrl.api.env_api import EnvironmentService

    class HalfCredit(EnvironmentService):
        async def step(self, answers):
            return None, [0.5 if a == "8" else float(a == "81") for a in answers], True, False, {}

    agent_ = agent("single-step", tokenizer_path, group_size=3, success_rate_lb=0.5)
    trajs, _ = run_episode(
        agent_, HalfCredit(), record(tokenizer), lambda req: generation_result(tokenizer, req, ["8", "81", "81"])
    )
    (traj,) = trajs
    assert traj.scores == [0.5, 1.0, 1.0] and traj.reward == pytest.approx([0.0, 1.0, 1.0])
    # Evaluation: greedy, one answer, no filter (this group would fail lb=0.5).
    evaluating = make_agent("single-step", agent_.settings.for_evaluation(max_new_tokens=5))
    trajs, requests = run_episode(
        evaluating,
        HalfCredit(),
        record(tokenizer),
        lambda req: generation_result(tokenizer, req, ["8"] * req.group_size),
    )
    assert trajs[0].scores == [0.5]
    assert requests[0].group_size == 1 and requests[0].gconfig.greedy and requests[0].gconfig.max_new_tokens == 5


# ---------------------------------------------------------------- multi-turn agent


def test_multi_turn_feedback_context_and_discounted_rewards(tokenizer, tokenizer_path):
    agent_ = agent("math-multi-turn", tokenizer_path, {"num_turns": 3, "turn_level_discount": 0.5}, group_size=2)
    prompt = record(tokenizer)

    # Chain 0: wrong "7", wrong "9", right "81". Chain 1: right at once.
    def answer(request: GenerationRequest) -> GenerationResult:
        context = tokenizer.decode(request.prompt_ids)
        if context == PROMPT:
            return generation_result(tokenizer, request, ["7", "81"])
        if context == PROMPT + "7" + DEFAULT_FEEDBACK:
            return generation_result(tokenizer, request, ["9"])
        if context == PROMPT + "7" + DEFAULT_FEEDBACK + "9" + DEFAULT_FEEDBACK:
            return generation_result(tokenizer, request, ["81"])
        raise AssertionError(f"unexpected context {context!r}")

    trajs, requests = run_episode(agent_, make_env("math"), prompt, answer)
    assert [r.group_size for r in requests] == [2, 1, 1]
    # The eos the model emitted is not part of the next context.
    assert tokenizer.eos_token_id not in requests[1].prompt_ids + requests[2].prompt_ids

    (traj,) = trajs
    traj.validate()
    assert traj.group_size == 4
    assert traj.metadata["chain"] == [0, 0, 0, 1]
    assert traj.metadata["turn"] == [0, 1, 2, 0]
    assert traj.metadata["answers"] == ["7", "9", "81", "81"]
    assert traj.scores == [0.0, 0.0, 1.0, 1.0]
    # Solved at turn 2: earlier turns get 0.5**2, 0.5**1.
    assert traj.metadata["credit"] == [0.25, 0.5, 1.0, 1.0]
    assert traj.reward == pytest.approx([-0.5, 0.0, 1.0, 1.0])
    contexts = [requests[0].prompt_ids, requests[1].prompt_ids, requests[2].prompt_ids, requests[0].prompt_ids]
    for i, context in enumerate(contexts):
        assert traj.prompt_len[i] == len(context)
        assert traj.input_ids[i][: traj.prompt_len[i]].tolist() == context
        assert tokenizer.decode(traj.completion_ids(i), skip_special_tokens=True) == traj.metadata["answers"][i]
    assert traj.metadata["solve_rate"] == 1.0 and traj.metadata["first_turn_accuracy"] == 0.5
    stats = agent_.pop_stats()
    assert stats["n_answers"] == 4 and stats["accuracy"] == 0.5 and stats["solve_rate"] == 1.0


def test_multi_turn_unsolved_chain_stops_after_num_turns(tokenizer, tokenizer_path):
    agent_ = agent(
        "math-multi-turn",
        tokenizer_path,
        {"num_turns": 3, "turn_level_discount": 0.9, "feedback": "\nNo.\nA:"},
        group_size=1,
        reward_scaling=0.5,
    )
    trajs, requests = run_episode(
        agent_, make_env("math"), record(tokenizer), lambda req: generation_result(tokenizer, req, ["5"])
    )
    assert len(requests) == 3
    assert tokenizer.decode(requests[2].prompt_ids) == PROMPT + "5\nNo.\nA:5\nNo.\nA:"
    (traj,) = trajs
    assert traj.metadata["credit"] == [0.0, 0.0, 0.0]
    assert traj.reward == pytest.approx([-0.5, -0.5, -0.5])  # unsolved chains: every turn -1 * scaling


def test_multi_turn_context_limit_and_success_filter(tokenizer, tokenizer_path):
    prompt = record(tokenizer)
    # Room for the prompt + one answer, not for a second turn's context.
    limit = len(prompt.prompt_ids) + 16 + 5
    agent_ = agent(
        "math-multi-turn",
        tokenizer_path,
        {"num_turns": 4, "max_context_tokens": limit},
        group_size=2,
        gconfig={"max_new_tokens": 16},
    )
    trajs, requests = run_episode(
        agent_, make_env("math"), prompt, lambda req: generation_result(tokenizer, req, ["1"] * req.group_size)
    )
    assert len(requests) == 1 and trajs[0].group_size == 2

    picky = agent("math-multi-turn", tokenizer_path, {"num_turns": 2}, group_size=2, success_rate_ub=0.9)
    trajs, requests = run_episode(
        picky, make_env("math"), prompt, lambda req: generation_result(tokenizer, req, ["1", "81"][: req.group_size])
    )
    # chain 0 answers "1" twice (wrong), chain 1 "81" at once: solve_rate 0.5, kept
    assert len(requests) == 2 and len(trajs) == 1
    all_right, _ = run_episode(
        picky, make_env("math"), prompt, lambda req: generation_result(tokenizer, req, ["81"] * req.group_size)
    )
    assert all_right == []  # every chain solved: solve_rate 1 > ub
    assert picky.pop_stats()["n_rejected"] == 1.0


def test_multi_turn_retries_of_a_group_are_in_flight_together(tokenizer, tokenizer_path):
    agent_ = agent("math-multi-turn", tokenizer_path, {"num_turns": 2}, group_size=4)
    generator = ScriptedGenerator(lambda req: generation_result(tokenizer, req, ["1"] * req.group_size))
    (traj,) = asyncio.run(agent_.run_episode(record(tokenizer), make_env("math"), generator))
    assert [r.group_size for r in generator.requests] == [4, 1, 1, 1, 1]
    assert generator.max_in_flight == 4  # the four retries overlapped
    assert traj.metadata["max_generate_in_flight"] == 4 and traj.metadata["generate_calls"] == 5
    assert traj.group_size == 8 and traj.metadata["turn"] == [0, 1] * 4
    # Which call answered each sequence (chain-major): every chain's first answer came from call 1,
    # the retries from calls 2..5 in the order the agent made them.
    assert traj.metadata["answer_turn"] == [1, 2, 1, 3, 1, 4, 1, 5]


def test_generate_outside_an_episode_says_so(tokenizer_path):
    agent_ = agent("single-step", tokenizer_path)
    with pytest.raises(RuntimeError, match="only available inside an episode"):
        asyncio.run(agent_.generate([1, 2, 3]))


def test_reward_fn_env_passes_floats_and_row_fields_and_counts_failures(tmp_path, tokenizer):
    (tmp_path / "task.py").write_text(
        "import time\n"
        "def reward(prompt, completion, answer, unit, **row):\n"
        "    if completion == 'hang':\n"
        "        time.sleep(60)\n"
        "    if completion == 'boom':\n"
        "        raise ValueError('bad')\n"
        "    return 1.0 if completion == answer + unit else 0.37\n"
    )
    env = make_env("reward-fn", fn=f"{tmp_path / 'task.py'}:reward", timeout_s=1.0)
    prompt = PromptRecord(qid="q", prompt="How long?", prompt_ids=[1], solutions=["3"], row={"unit": "m"})

    async def main():
        await env.reset(options={"prompt": prompt})
        return await env.step(["3m", "3", "hang", "boom"])

    from realrl.impl.environments.reward_fn_env import close_runners

    try:
        _, scores, _, _, info = asyncio.run(main())
    finally:
        close_runners()
    assert scores == [1.0, 0.37, 0.0, 0.0]
    assert info == {"reward_timeouts": 1, "reward_errors": 1}


def test_an_evaluation_whose_generator_fails_raises_instead_of_waiting(tokenizer, tokenizer_path):
    """A model that fails to generate (e.g. under FSDP) leaves every episode
    waiting for an answer; the evaluation ends with the generator's error."""
    from realrl.impl.evaluation import ModelGenerator, evaluate_prompts

    class Broken:
        def generate(self, **kwargs):
            raise RuntimeError("generation failed")

    generator = ModelGenerator(Broken(), tokenizer, device=None, version=0)
    evaluating = make_agent("single-step", AgentSettings(tokenizer_path=tokenizer_path).for_evaluation(4))
    prompts = [record(tokenizer, qid=f"q-{i}") for i in range(3)]
    with pytest.raises(RuntimeError, match="generation failed"):
        asyncio.run(asyncio.wait_for(evaluate_prompts(evaluating, lambda: make_env("math"), prompts, generator), 60))


def test_the_next_turn_starts_at_the_chat_templates_turn_boundary(tmp_path, tokenizer_path):
    from realrl.impl.tiny_model import build_kit_tokenizer

    kit_path = str(tmp_path / "kit_tokenizer")
    build_kit_tokenizer().save_pretrained(kit_path)
    for path, template in ((kit_path, True), (tokenizer_path, False)):
        agent = make_agent("single-step", AgentSettings(tokenizer_path=path))
        tok, eos = agent.tokenizer, agent.tokenizer.eos_token_id
        prompt, answer = tok.encode("Q: 1+2=?\nA:"), tok.encode("4?")
        hint = tok.encode("Try again.\nA:")
        if template:  # the kit's turn boundary is the EOS that ended the answer: kept, never re-encoded
            assert agent.next_turn_prompt(prompt, answer + [eos], "Try again.\nA:") == prompt + answer + [eos] + hint
            # an answer cut by length gets the turn end the template would have put there
            assert agent.next_turn_prompt(prompt, answer, "Try again.\nA:") == prompt + answer + [eos] + hint
            tool = agent.next_turn_prompt(prompt, answer + [eos], "3", role="tool")
            assert tok.decode(tool[len(prompt) + len(answer) + 1 :]) == "<tool_response>3</tool_response>"
        else:  # no chat template: no EOS mid-conversation
            assert agent.next_turn_prompt(prompt, answer + [eos], "Try again.\nA:") == prompt + answer + hint
