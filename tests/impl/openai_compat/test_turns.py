"""Token-in, token-out across chat calls (realrl/impl/openai_compat/turns.py):
the trained tokens are the sampled ones, whatever re-rendering the messages
would give."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from realrl.api.agent_api import PromptRecord
from realrl.api.generation_api import GenerationHyperparameters, GenerationRequest
from realrl.api.openai_api import ChatCompletionRequest
from realrl.api.trajectory import Sampling, Trajectory
from realrl.base.http_body import from_json, to_json
from realrl.impl.openai_compat.chat import ChatConfig, ChatSession, ContextLengthExceeded
from realrl.impl.openai_compat.rendering import ChatRenderer
from realrl.impl.openai_compat.tool_calls import TOOL_PARSERS
from tests.impl.openai_compat.chat_kit import (
    THINK_STRIPPING_TEMPLATE,
    ScriptedGenerator,
    bpe_chat_tokenizer,
    byte_split,
    char_chat_tokenizer,
)

ADD_TOOL = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}},
}


def make_session(tokenizer, outputs, max_new_tokens=64, max_context_tokens=None, greedy=False):
    eos = frozenset({tokenizer.eos_token_id})
    policy = ScriptedGenerator([list(o) for o in outputs], eos)
    config = ChatConfig(
        tokenizer=tokenizer,
        renderer=ChatRenderer(tokenizer, eos),
        gconfig=GenerationHyperparameters(max_new_tokens=max_new_tokens, greedy=greedy),
        tool_parser=TOOL_PARSERS.get("hermes"),
        max_context_tokens=max_context_tokens,
    )

    async def generate(prompt_ids, n, gconfig):
        return await policy.generate(GenerationRequest("q@0", prompt_ids, n, gconfig))

    return ChatSession(config, generate, "q@0"), policy


def call(session, messages, **fields):
    request = from_json(ChatCompletionRequest, {"model": "m", "messages": messages, **fields})
    return to_json(asyncio.run(session.complete(request)))


def render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=False, **kwargs
    )


def test_trained_tokens_are_the_sampled_ones_where_rendering_the_history_changes_them():
    """Qwen2.5's template re-formats tool-call JSON, and a BPE tokenizer merges
    a byte-by-byte sample: rendering the conversation again gives other tokens
    than the policy sampled. The recorded sequence keeps the sampled ones."""
    tok = bpe_chat_tokenizer()
    eos, call_open, call_close = tok.eos_token_id, *tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    sampled_1 = (
        byte_split(tok, "Let me add.\n")
        + [call_open]
        + byte_split(tok, '\n{"name":"add","arguments":{"a":1,"b":2}}\n')
        + [call_close, eos]
    )
    sampled_2 = byte_split(tok, "The answer is 3.") + [eos]
    session, policy = make_session(tok, [sampled_1, sampled_2])

    messages = [{"role": "user", "content": "What is 1+2?"}]
    first = call(session, messages, tools=[ADD_TOOL])
    reply = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    assert reply["content"] == "Let me add."
    # The arguments exactly as sampled (compact JSON), as a string.
    assert reply["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a":1,"b":2}'}

    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "3"}]
    second = call(session, messages, tools=[ADD_TOOL])
    assert second["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": "The answer is 3."},
        "finish_reason": "stop",
        "logprobs": None,
    }
    turn_1, turn_2 = session.recorder.turns
    assert turn_2.stitched_onto == 0
    assert turn_2.prompt_ids[: len(turn_1.prompt_ids) + len(sampled_1)] == turn_1.prompt_ids + sampled_1
    # Rendering the same conversation from scratch gives other tokens: the
    # naive construction would train on tokens the policy never sampled.
    naive = tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=True)
    assert naive != turn_2.prompt_ids
    assert policy.requests[1].prompt_ids == turn_2.prompt_ids

    (sequence,) = session.recorder.sequences("chains")
    assert sequence.turns == [0, 1]
    assert sequence.input_ids.tolist() == turn_2.prompt_ids + sampled_2
    assert sequence.prompt_len == len(turn_1.prompt_ids)
    completion = sequence.input_ids[sequence.prompt_len :]
    # Loss exactly on the sampled tokens: each turn's sampled ids, nothing else.
    assert completion[sequence.loss_mask].tolist() == sampled_1 + sampled_2
    bridge = len(turn_2.prompt_ids) - len(turn_1.prompt_ids) - len(sampled_1)
    assert sequence.loss_mask.tolist() == [True] * len(sampled_1) + [False] * bridge + [True] * len(sampled_2)
    assert sequence.logprobs[~sequence.loss_mask].tolist() == [0.0] * bridge
    assert (sequence.versions[sequence.loss_mask] == 3).all() and (sequence.versions[~sequence.loss_mask] == -1).all()

    # The contract carries it: a trajectory with the loss mask survives the wire.
    traj = Trajectory(
        qid="q@0",
        task="math",
        birth_time=0.0,
        input_ids=[sequence.input_ids],
        prompt_len=[sequence.prompt_len],
        logprobs=[sequence.logprobs],
        versions=[sequence.versions],
        version_start=[sequence.version_start],
        version_end=[sequence.version_end],
        reward=[1.0],
        no_eos=[sequence.no_eos],
        loss_mask=[sequence.loss_mask],
    ).validate()
    back = Trajectory.from_wire(traj.to_wire())
    assert back.loss_mask[0].tolist() == sequence.loss_mask.tolist()
    assert Trajectory.from_wire({**traj.to_wire(), "loss_mask": np.zeros(0, np.bool_)}).loss_mask == []


def test_reasoning_that_the_template_strips_from_history_stays_trained():
    """Qwen3-style templates drop earlier turns' <think> part once a new user
    message follows; the recorded conversation keeps what was sampled."""
    tok = char_chat_tokenizer(THINK_STRIPPING_TEMPLATE)
    eos = tok.eos_token_id
    sampled_1 = tok.encode("<think>\nsmall\n</think>\n\nIt is 3.", add_special_tokens=False) + [eos]
    sampled_2 = tok.encode("It is 7.", add_special_tokens=False) + [eos]
    session, _ = make_session(tok, [sampled_1, sampled_2])
    messages = [{"role": "user", "content": "1+2?"}]
    reply = call(session, messages)["choices"][0]["message"]
    messages += [reply, {"role": "user", "content": "3+4?"}]
    call(session, messages)
    (sequence,) = session.recorder.sequences("chains")
    completion = sequence.input_ids[sequence.prompt_len :]
    assert completion[sequence.loss_mask].tolist() == sampled_1 + sampled_2
    assert "<think>" in tok.decode(sequence.input_ids)
    re_rendered = render(tok, messages + [{"role": "assistant", "content": "It is 7."}])
    assert "<think>" not in tok.decode(re_rendered)


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_turn_cut_by_length_is_rendered_again_and_chained_only_if_its_tokens_come_back(kind):
    """No turn-end token to continue after: the next call renders the
    conversation. With the character tokenizer that reproduces the sampled
    tokens (the template's turn end after them is context); a byte-by-byte
    BPE sample comes back merged, so the next turn is a sequence of its own."""
    tok = char_chat_tokenizer() if kind == "char" else bpe_chat_tokenizer()
    eos = tok.eos_token_id
    session, _ = make_session(tok, [byte_split(tok, "The answer"), byte_split(tok, "ok") + [eos]], 10)
    messages = [{"role": "user", "content": "hi"}]
    first = call(session, messages)
    assert first["choices"][0]["finish_reason"] == "length"
    messages += [first["choices"][0]["message"], {"role": "user", "content": "go on"}]
    call(session, messages)
    assert session.recorder.turns[1].stitched_onto is None
    assert session.recorder.prompts == {"rendered: first call": 1, "rendered: the previous turn ended by length": 1}
    sequences = session.recorder.sequences("chains")
    if kind == "char":
        (sequence,) = sequences
        completion = sequence.input_ids[sequence.prompt_len :]
        assert completion[sequence.loss_mask].tolist() == byte_split(tok, "The answer") + byte_split(tok, "ok") + [eos]
        assert completion[len("The answer")] == eos and not sequence.loss_mask[len("The answer")]
    else:
        assert [s.turns for s in sequences] == [[0], [1]]
        assert all(s.loss_mask.all() for s in sequences)
        assert sequences[0].no_eos and not sequences[1].no_eos


def test_a_forked_conversation_trains_every_sampled_token_once():
    tok = char_chat_tokenizer()
    eos = tok.eos_token_id
    outs = [tok.encode(t, add_special_tokens=False) + [eos] for t in ("A", "B", "C")]
    session, _ = make_session(tok, outs)
    messages = [{"role": "user", "content": "hi"}]
    reply = call(session, messages)["choices"][0]["message"]
    call(session, [*messages, reply, {"role": "user", "content": "left"}])
    call(session, [*messages, reply, {"role": "user", "content": "right"}])
    sequences = session.recorder.sequences("chains")
    assert [s.turns for s in sequences] == [[0, 1], [2]]
    sampled = sum(len(o) for o in outs)
    assert sum(int(s.loss_mask.sum()) for s in sequences) == sampled
    assert sequences[1].prompt_len == len(session.recorder.turns[2].prompt_ids)  # its own prompt: turn 0 is context


def test_the_agent_continues_the_choice_it_echoes():
    tok = char_chat_tokenizer()
    eos = tok.eos_token_id
    outs = [tok.encode(t, add_special_tokens=False) + [eos] for t in ("first", "second", "next")]
    session, policy = make_session(tok, outs)
    messages = [{"role": "user", "content": "hi"}]
    answer = call(session, messages, n=2)
    assert [c["message"]["content"] for c in answer["choices"]] == ["first", "second"]
    assert answer["usage"] == {
        "prompt_tokens": len(policy.requests[0].prompt_ids),
        "completion_tokens": len(outs[0]) + len(outs[1]),
        "total_tokens": len(policy.requests[0].prompt_ids) + len(outs[0]) + len(outs[1]),
    }
    call(session, [*messages, answer["choices"][1]["message"], {"role": "user", "content": "more"}])
    assert session.recorder.turns[2].stitched_onto == 1
    assert [s.turns for s in session.recorder.sequences("chains")] == [[0], [1, 2]]
    assert [s.turns for s in session.recorder.sequences("turns")] == [[0], [1], [2]]


def test_calls_sampled_differently_or_with_other_tools_are_separate_sequences():
    tok = char_chat_tokenizer()
    eos = tok.eos_token_id
    outs = [tok.encode(t, add_special_tokens=False) + [eos] for t in ("A", "B", "C")]
    session, policy = make_session(tok, outs)
    messages = [{"role": "user", "content": "hi"}]
    reply = call(session, messages)["choices"][0]["message"]
    messages += [reply, {"role": "user", "content": "again"}]
    second = call(session, messages, top_p=0.5)  # continues turn 0's tokens, at another top_p
    assert session.recorder.turns[1].stitched_onto == 0 and policy.requests[1].gconfig.top_p == 0.5
    messages += [second["choices"][0]["message"], {"role": "user", "content": "and again"}]
    call(session, messages, top_p=0.5, tools=[ADD_TOOL])
    assert session.recorder.turns[2].stitched_onto is None
    assert [s.turns for s in session.recorder.sequences("chains")] == [[0], [1], [2]]


def test_stop_strings_end_the_content_and_the_recorded_tokens():
    tok = char_chat_tokenizer()
    out = tok.encode("Thought: x\nObservation: y", add_special_tokens=False) + [tok.eos_token_id]
    session, policy = make_session(tok, [out])
    answer = call(session, [{"role": "user", "content": "go"}], stop=["Observation:", "\n\n"])
    assert answer["choices"][0]["message"]["content"] == "Thought: x\n"
    assert answer["choices"][0]["finish_reason"] == "stop"
    kept = len("Thought: x\nObservation:")
    assert session.recorder.turns[0].output_ids == out[:kept]
    assert answer["usage"]["completion_tokens"] == kept


def test_calls_stay_within_the_models_context():
    tok = char_chat_tokenizer()
    session, policy = make_session(tok, [[tok.eos_token_id]], max_new_tokens=100, max_context_tokens=40)
    call(session, [{"role": "user", "content": "hi"}], max_tokens=50)
    prompt = len(policy.requests[0].prompt_ids)
    assert policy.requests[0].gconfig.max_new_tokens == 40 - prompt
    with pytest.raises(ContextLengthExceeded, match="context is 40 tokens"):
        call(session, [{"role": "user", "content": "x" * 40}])


def test_a_calls_own_temperature_is_recorded_with_its_turn():
    """Each call samples at its own temperature (the run's when it names
    none) and its turn records it, with its sampling logprobs, for the
    trainer to recompute at (docs/design.md §5)."""
    tok = char_chat_tokenizer()
    user = [{"role": "user", "content": "hi"}]
    session, policy = make_session(tok, [[tok.eos_token_id]] * 3)
    call(session, user, temperature=0.5, top_p=0.9)
    call(session, user)
    call(session, user, temperature=0)  # greedy
    assert [r.gconfig.temperature for r in policy.requests[:2]] == [0.5, 1.0]
    recorded = [turn.result.sampling for turn in session.recorder.turns]
    assert recorded == [Sampling(0.5, top_p=0.9), Sampling(1.0), Sampling(0.0)]
    traj = Trajectory.from_results(
        PromptRecord("q@0", "hi", [1], []), [t.result for t in session.recorder.turns], [0.0] * 3, [0.0] * 3
    )
    assert traj.sampling == recorded
    assert [s.logprob_temperature for s in traj.sampling] == [0.5, 1.0, 1.0]
    assert traj.sampling_logprobs[0].tolist() == pytest.approx([-0.2])
    sequences = session.recorder.sequences("chains")
    assert sequences[0].sampling_logprobs.tolist() == pytest.approx([-0.2])
    evaluation, policy = make_session(tok, [[tok.eos_token_id]] * 2, greedy=True)  # evaluation is greedy
    call(evaluation, user, temperature=1.0)
    call(evaluation, user, temperature=0)
    assert all(r.gconfig.greedy for r in policy.requests)
