"""Dataset rows: reading them, their keys, answers, and rendering prompts (docs/design.md §13).

The one reader for rollouts, evaluation and `realrl eval`:

- **Files**, chosen by what the path is: a directory written by
  `datasets.save_to_disk` (read with `datasets.load_from_disk`), a `.parquet`
  file (pyarrow), or JSON lines (`.jsonl`, any other name).
- **Keys** (`dataset.*`): `prompt_key` (a string), `answer_key` (a string, a
  number, or a list of accepted answers), `id_key` (ids are generated as
  `<file>-<row>` when the key is absent). Dotted keys reach into nested
  fields (`extra_info.question`). The older `solutions` list is still
  accepted in place of the answer. A row may carry `messages` (a list of
  `{role, content}`, the conversational format TRL and verl use) instead of
  a prompt string.
- **Answers**: a GSM8K-style answer (`... #### 42`) verifies against what
  follows the last `####`; a `\\boxed{...}` answer against the box's content.
- **Rendering** (`render_prompt`): `messages` go through the tokenizer's chat
  template with a generation prompt; a plain prompt for a tokenizer with a
  chat template becomes one user message (after `dataset.system_prompt`).
  `dataset.chat_template=false`, or a tokenizer without a template, leaves a
  plain prompt as raw text, encoded with the tokenizer's own special tokens
  (BOS where the tokenizer adds one). Templated text is encoded without
  them: the template writes its own BOS.

A malformed file or row raises ValueError naming the file and row (the
launcher turns it into a one-line config error before anything starts); rows
longer than `max_prompt_len` tokens, or empty, are skipped and counted.
"""

from __future__ import annotations

import collections
import os
from typing import Any

from realrl.api.agent_api import PromptRecord
from realrl.api.cli_args import DatasetConfig
from realrl.impl.math_data import read_json_lines

# Fields the runtime reads itself; every other field of a row reaches reward
# functions and agents (`PromptRecord.row`).
RUNTIME_FIELDS = ("query_id", "prompt", "answer", "solutions", "task")


def read_rows(path: str) -> list[dict[str, Any]]:
    """Every row of a dataset file or `save_to_disk` directory, as dicts."""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "dataset_info.json")) and not os.path.exists(
            os.path.join(path, "dataset_dict.json")
        ):
            raise ValueError(f"{path}: a directory but not one written by datasets.save_to_disk")
        import datasets  # heavy: only for this format

        loaded = datasets.load_from_disk(path)
        if isinstance(loaded, datasets.DatasetDict):
            splits = list(loaded)
            if len(splits) != 1:
                raise ValueError(f"{path}: holds the splits {splits}; give the directory of one split")
            loaded = loaded[splits[0]]
        return loaded.to_list()
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several kinds for a broken file
            raise ValueError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    return [row for _, row in read_json_lines(path)]


def field(row: dict[str, Any], key: str) -> Any:
    """`row[key]`, where a dotted key reaches into nested dicts; None when absent."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (nested braces kept)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def reference_answer(answer: str) -> str:
    """The answer a completion must match: after GSM8K's last `####`, else a
    `\\boxed{}`'s content, else the answer as given."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    boxed = last_boxed(answer)
    return boxed.strip() if boxed is not None else answer.strip()


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: every message needs a string 'role' and 'content', got {m!r}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def load_records(path: str, cfg: DatasetConfig) -> list[dict[str, Any]]:
    """The rows of `path` with the runtime's fields named as the runtime reads
    them: `query_id` (str, unique: repeats get `#1`, `#2`, ...), `prompt`
    (str, "" for a conversation), `messages` (list, or absent), `answer`,
    `solutions` (accepted answers), `task`; the row's other fields as they are."""
    name = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
    records = []
    seen: collections.Counter = collections.Counter()
    for i, row in enumerate(read_rows(path)):
        where = f"{path}: row {i + 1}"
        prompt, messages = field(row, cfg.prompt_key), row.get("messages")
        if messages is not None:
            messages = _messages(messages, where)
        elif not isinstance(prompt, str):
            what = "missing" if prompt is None else f"not a string ({type(prompt).__name__})"
            raise ValueError(
                f"{where}: prompt key {cfg.prompt_key!r} {what} and no 'messages' (dataset.prompt_key); "
                f"the row's fields: {_fields(row)}"
            )
        raw = field(row, cfg.answer_key)
        if raw is None:
            raw = row.get("solutions")
        if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise ValueError(
                f"{where}: answer key {cfg.answer_key!r} missing or empty (dataset.answer_key); "
                f"the row's fields: {_fields(row)}"
            )
        solutions = [reference_answer(str(a)) for a in raw]
        qid = field(row, cfg.id_key)
        qid = f"{name}-{i}" if qid is None else str(qid)
        seen[qid] += 1
        if seen[qid] > 1:  # keep episode ids unique even if the data set repeats an id
            qid = f"{qid}#{seen[qid] - 1}"
        record = {k: v for k, v in row.items() if k not in (cfg.prompt_key, cfg.answer_key, cfg.id_key)}
        record.update(
            query_id=qid,
            prompt=prompt if isinstance(prompt, str) else "",
            answer=solutions[0],
            solutions=solutions,
            task=str(row.get("task") or "math"),
        )
        if messages is not None:
            record["messages"] = messages
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no rows")
    return records


def _fields(row: dict[str, Any]) -> str:
    """The row's keys, nested ones dotted (what dataset.prompt_key and answer_key can name)."""
    keys = []
    for k, v in row.items():
        keys += [f"{k}.{sub}" for sub in v] if isinstance(v, dict) and v else [str(k)]
    return ", ".join(keys)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(record: dict[str, Any], tokenizer: Any, cfg: DatasetConfig) -> tuple[str, list[int], list | None]:
    """(text, token ids, messages) of a record's prompt as the model sees it;
    messages None when the prompt is raw text."""
    messages = record.get("messages")
    templated = cfg.chat_template and has_chat_template(tokenizer)
    if messages is None and templated:
        messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        messages.append({"role": "user", "content": record["prompt"]})
    if messages is None:
        text = record["prompt"]
        return text, list(tokenizer.encode(text, add_special_tokens=True)), None
    if not templated:
        why = "dataset.chat_template=false" if has_chat_template(tokenizer) else "the tokenizer has no chat template"
        raise ValueError(f"query {record['query_id']}: a 'messages' row cannot be rendered ({why})")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, list(tokenizer.encode(text, add_special_tokens=False)), messages


def template_notice(tokenizer: Any, cfg: DatasetConfig, records: list[dict[str, Any]]) -> str | None:
    """What the launcher says on the console (once, before the trial starts)
    when the prompts reach the model as raw text: the model has a chat
    template the config switched off, or none at all (None: templated, or
    every row a conversation, which a missing template refuses)."""
    plain = next((r for r in records if r.get("messages") is None), None)
    if plain is None:
        return None
    if has_chat_template(tokenizer) and not cfg.chat_template:
        return (
            "the model has a chat template that the prompts do not use (dataset.chat_template=false): "
            "a chat model usually answers badly to raw text"
        )
    if not has_chat_template(tokenizer) and cfg.chat_template:
        return (
            f"the tokenizer of model.path has no chat template: the prompts reach the model as raw text, "
            f"e.g. {plain['prompt'][:80]!r} (right for a base model; a chat model needs its template, "
            f"and dataset.chat_template=false says raw text is meant)"
        )
    return None


def prompt_records(
    records: list[dict[str, Any]], tokenizer: Any, cfg: DatasetConfig, max_prompt_len: int | None = None
) -> tuple[list[PromptRecord], int]:
    """The records as the agents get them, and how many were skipped (empty,
    or longer than `max_prompt_len` tokens). A templated record's row carries
    the conversation as `messages`."""
    prompts, skipped = [], 0
    for r in records:
        text, ids, messages = render_prompt(r, tokenizer, cfg)
        if not ids or (max_prompt_len is not None and len(ids) > max_prompt_len):
            skipped += 1
            continue
        row = {k: v for k, v in r.items() if k not in RUNTIME_FIELDS}
        if messages is not None:
            row["messages"] = messages
        prompts.append(
            PromptRecord(
                qid=r["query_id"],
                prompt=text,
                prompt_ids=ids,
                solutions=list(r["solutions"]),
                task=r["task"],
                row=row,
            )
        )
    return prompts, skipped
