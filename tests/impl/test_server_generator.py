"""Trying an agent offline: the multi-turn agent against one real torch
server through `ServerGenerator`, no trial (the workflow docs/custom_tasks.md
describes)."""

from __future__ import annotations

import asyncio

import pytest

import realrl.impl.agents  # noqa: F401  (registers the built-ins)
import realrl.impl.environments  # noqa: F401
from realrl.api.agent_api import AgentSettings, PromptRecord, make_agent
from realrl.api.env_api import make_env
from realrl.impl.generation.server_generator import ServerGenerator
from realrl.impl.tiny_model import TinyModelConfig, build_char_tokenizer, build_tiny_model


@pytest.fixture(scope="module")
def char_model_dir(tmp_path_factory) -> str:
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        tokenizer,
        TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=512),
        seed=5,
    )
    path = str(tmp_path_factory.mktemp("char_model"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_multi_turn_agent_against_a_local_server(char_model_dir, start_server):
    server = start_server(char_model_dir)
    settings = AgentSettings(tokenizer_path=char_model_dir, group_size=3, gconfig={"max_new_tokens": 4})
    agent = make_agent("math-multi-turn", settings, num_turns=2)
    tok = agent.tokenizer
    prompts = [
        PromptRecord(
            qid=f"q{i}",
            prompt=f"Q: {i}+1=?\nA:",
            solutions=[str(i + 1)],
            prompt_ids=tok.encode(f"Q: {i}+1=?\nA:", add_special_tokens=False),
        )
        for i in range(4)
    ]

    async def main():
        generator = ServerGenerator(server.url)
        try:
            return await asyncio.gather(
                *(agent.run_episode(p, make_env("math", answer_format="exact"), generator) for p in prompts)
            )
        finally:
            await generator.close()

    results = asyncio.run(main())
    for prompt, (traj,) in zip(prompts, results):
        assert traj.qid == prompt.qid and traj.group_size >= 3  # every chain's first answer, plus retries
        assert len(traj.scores) == traj.group_size and all(s in (0.0, 1.0) for s in traj.scores)
        for i in range(traj.group_size):  # a random model: answers of up to 4 tokens, with real logprobs
            assert 0 < len(traj.completion_ids(i)) <= 4 and (traj.logprobs[i] <= 0).all()
        # An untrained model rarely solves: the wrong chains retried, all at once.
        if traj.group_size > 4:
            assert traj.metadata["max_generate_in_flight"] >= 2
