"""Real-format tokenizers with chat templates for the endpoint's tests, and a
policy that samples what a test scripts.

- `char_chat_tokenizer()`: the tiny kit's character tokenizer plus
  Qwen-style specials (`<|im_start|>`, `<|im_end|>` = EOS) and added tool and
  reasoning tokens, with `TOOL_TEMPLATE`: turns `<|im_start|>ROLE\\n...<|im_end|>\\n`,
  tools listed in the system turn, tool calls `<tool_call>{json}</tool_call>`
  (string arguments printed as they are), history never rewritten.
- `bpe_chat_tokenizer()`: a byte-level BPE trained here on a few sentences,
  with `QWEN25_TEMPLATE`, which (like Qwen2.5's) prints tool-call arguments
  through `tojson` and merges tool results into a user turn, and
  `QWEN3_TEMPLATE` behaviour (drop `<think>...</think>` from assistant turns
  before the last user message) available as `THINK_STRIPPING_TEMPLATE`.
- `ScriptedGenerator`: the `Generator` protocol (what the rollout worker's
  partial rollouts implement), answering each request with the next scripted
  token ids: a policy whose samples a test chooses, to hit exact cases (a
  non-canonical BPE split, compact tool-call JSON) that a random model would
  produce only by chance.
"""

from __future__ import annotations

import dataclasses

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from realrl.api.generation_api import GenerationRequest, GenerationResult
from realrl.impl.tiny_model import build_char_tokenizer

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

TOOL_TEMPLATE = (
    "{%- set ns = namespace(sys='') -%}"
    "{%- if messages and messages[0].role == 'system' -%}{%- set ns.sys = messages[0].content -%}{%- endif -%}"
    "{%- if ns.sys or tools -%}"
    "{{- '<|im_start|>system\\n' + ns.sys -}}"
    "{%- if tools -%}{{- ('\\n' if ns.sys else '') + '# Tools' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (m.content if m.content is string else '') -}}"
    "{%- for tc in (m.tool_calls or []) -%}{%- set f = tc.function -%}"
    '{{- \'<tool_call>{"name": "\' + f.name + \'", "arguments": \' -}}'
    "{{- f.arguments if f.arguments is string else (f.arguments | tojson) -}}"
    "{{- '}</tool_call>' -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen2.5's structure: arguments through tojson (a string is encoded a second
# time), tool results merged into one user turn.
QWEN25_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' -}}{%- if m.content -%}{{- '\\n' + m.content -}}{%- endif -%}"
    "{%- for tc in (m.tool_calls or []) -%}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' -}}'
    "{{- tc.function.arguments | tojson -}}{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Qwen3's history rewriting: an assistant turn before the last user message
# loses its <think>...</think> part.
THINK_STRIPPING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}"
    "{%- if loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def char_chat_tokenizer(template: str = TOOL_TEMPLATE) -> PreTrainedTokenizerFast:
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[:2]})
    tokenizer.add_tokens(ADDED)
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = template
    return tokenizer


CORPUS = [
    "The answer is 42. Let me add the numbers first.",
    'The tool call {"name": "add", "arguments": {"a": 1, "b": 2}} returns 3.',
    "hello world, the sum of these numbers is the answer",
] * 20


def bpe_chat_tokenizer(template: str = QWEN25_TEMPLATE) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    tokenizer.add_tokens(ADDED)
    tokenizer.chat_template = template
    return tokenizer


def byte_split(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """`text` as one token per byte: a valid, non-canonical split of it."""
    return [tokenizer.convert_tokens_to_ids(t) for c in text for t in tokenizer.tokenize(c)]


@dataclasses.dataclass
class ScriptedGenerator:
    """Answers each request's answers with the next scripted outputs (token
    ids; logprob -0.25 - 0.01 * position, sampling logprob -0.2 - 0.01 *
    position, the given weight version), and keeps every request it got. An
    output that does not end with an EOS id ended by the length budget."""

    outputs: list[list[int]]
    eos_ids: frozenset[int]
    version: int = 3
    requests: list[GenerationRequest] = dataclasses.field(default_factory=list)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        outs = [self.outputs.pop(0)[: request.gconfig.max_new_tokens] for _ in range(request.group_size)]
        n = len(outs)
        return GenerationResult(
            qid=request.qid,
            prompt_ids=list(request.prompt_ids),
            output_ids=outs,
            output_logprobs=[[-0.25 - 0.01 * j for j in range(len(o))] for o in outs],
            output_versions=[[self.version] * len(o) for o in outs],
            no_eos=[not (o and o[-1] in self.eos_ids) for o in outs],
            version_start=[self.version] * n,
            version_end=[self.version] * n,
            output_sampling_logprobs=[[-0.2 - 0.01 * j for j in range(len(o))] for o in outs],
            sampling=request.gconfig.sampling(),
        )
