"""Dataset rows (realrl/impl/datasets.py): the three file formats, configurable
keys, generated ids, GSM8K and boxed answers, messages rows through a real
chat template, and one-line errors."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from realrl.api.cli_args import DatasetConfig
from realrl.impl import datasets
from realrl.impl.random_models import FAMILIES, train_tokenizer
from realrl.impl.tiny_model import build_char_tokenizer

GSM8K_ROWS = [
    {"question": "Natalia sold 48 clips. How many?", "answer": "She sold 48/2 = 24 more.\n#### 1,072"},
    {"question": "What is 2+2?", "answer": "The sum is \\boxed{\\frac{8}{2}}."},
]
GSM8K_KEYS = DatasetConfig(prompt_key="question", answer_key="answer", id_key="id")


@pytest.fixture(scope="module")
def chatml():
    return train_tokenizer(FAMILIES["qwen3"])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_parquet_and_save_to_disk_read_the_same_records(tmp_path):
    import datasets as hf_datasets

    jsonl = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    parquet = str(tmp_path / "gsm8k.parquet")
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), parquet)
    saved = str(tmp_path / "gsm8k")
    hf_datasets.Dataset.from_list(GSM8K_ROWS).save_to_disk(saved)
    by_format = [datasets.load_records(p, GSM8K_KEYS) for p in (jsonl, parquet, saved)]
    # ids generated from the file's name and row; the answers GSM8K's and the box's
    assert [r["query_id"] for r in by_format[0]] == ["gsm8k-0", "gsm8k-1"]
    assert [r["solutions"] for r in by_format[0]] == [["1072"], ["\\frac{8}{2}"]]
    assert [r["prompt"] for r in by_format[0]] == [r["question"] for r in GSM8K_ROWS]
    assert by_format[0] == by_format[1] == by_format[2]


def test_dotted_keys_answer_lists_repeated_ids_and_other_fields(tmp_path):
    rows = [
        {"uid": 7, "data": {"q": "Q1"}, "gold": ["3", "3.0"], "difficulty": 2},
        {"uid": 7, "data": {"q": "Q2"}, "gold": 4},
    ]
    cfg = DatasetConfig(prompt_key="data.q", answer_key="gold", id_key="uid")
    records = datasets.load_records(write_jsonl(tmp_path / "x.jsonl", rows), cfg)
    assert [r["query_id"] for r in records] == ["7", "7#1"]
    assert [r["prompt"] for r in records] == ["Q1", "Q2"] and records[0]["solutions"] == ["3", "3.0"]
    assert records[1]["solutions"] == ["4"] and records[0]["difficulty"] == 2


@pytest.mark.parametrize(
    "row, message",
    [
        (
            {"answer": "1"},
            "prompt key 'prompt' missing and no 'messages' (dataset.prompt_key); the row's fields: answer",
        ),
        (
            {"prompt": 3, "answer": "1"},
            "prompt key 'prompt' not a string (int) and no 'messages' (dataset.prompt_key); "
            "the row's fields: prompt, answer",
        ),
        ({"prompt": "p"}, "answer key 'answer' missing or empty (dataset.answer_key); the row's fields: prompt"),
        (
            {"messages": [{"role": "user"}], "answer": "1"},
            "every message needs a string 'role' and 'content', got {'role': 'user'}",
        ),
    ],
)
def test_bad_rows_name_the_file_row_and_key(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(ValueError) as e:
        datasets.load_records(path, DatasetConfig())
    assert str(e.value) == f"{path}: row 2: {message}"


def test_unreadable_files_are_one_line_errors(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="broken.parquet: not a readable Parquet file"):
        datasets.read_rows(str(broken))
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(ValueError, match="not one written by datasets.save_to_disk"):
        datasets.read_rows(str(tmp_path / "plain_dir"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n[1]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object, got list"):
        datasets.read_rows(str(bad))


def test_prompts_go_through_the_chat_template(chatml):
    records = [
        {"query_id": "a", "prompt": "Q: 1+2=?", "solutions": ["3"], "task": "math"},
        {
            "query_id": "b",
            "prompt": "",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q: 2+2=?"}],
            "solutions": ["4"],
            "task": "math",
        },
    ]
    cfg = DatasetConfig(system_prompt="Think.")
    prompts, skipped = datasets.prompt_records(records, chatml, cfg)
    assert skipped == 0
    assert prompts[0].prompt == (
        "<|im_start|>system\nThink.<|im_end|>\n<|im_start|>user\nQ: 1+2=?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompts[1].prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: 2+2=?<|im_end|>\n<|im_start|>assistant\n"
    )
    # the ids are the text's, special tokens as single ids; agents get the conversation
    assert prompts[0].prompt_ids[0] == chatml.convert_tokens_to_ids("<|im_start|>")
    assert chatml.decode(prompts[0].prompt_ids) == prompts[0].prompt
    assert prompts[0].row["messages"][-1] == {"role": "user", "content": "Q: 1+2=?"}
    # templating off: raw text; a conversation then cannot be rendered
    raw, _ = datasets.prompt_records(records[:1], chatml, DatasetConfig(chat_template=False))
    assert raw[0].prompt == "Q: 1+2=?" and "messages" not in raw[0].row
    with pytest.raises(
        ValueError, match="query b: a 'messages' row cannot be rendered \\(dataset.chat_template=false\\)"
    ):
        datasets.prompt_records(records, chatml, DatasetConfig(chat_template=False))


def test_bos_follows_the_tokenizer_and_long_prompts_are_skipped():
    llama3 = train_tokenizer(FAMILIES["llama3"])
    bos = llama3.convert_tokens_to_ids("<|begin_of_text|>")
    record = {"query_id": "a", "prompt": "Q: 1+2=?", "solutions": ["3"], "task": "math"}
    (templated,), _ = datasets.prompt_records([record], llama3, DatasetConfig())
    (raw,), _ = datasets.prompt_records([record], llama3, DatasetConfig(chat_template=False))
    assert templated.prompt_ids.count(bos) == 1 and templated.prompt_ids[0] == bos  # the template's, once
    assert raw.prompt_ids[0] == bos  # the tokenizer adds it to raw text
    # the tiny kit's character tokenizer adds nothing: its prompts encode as before
    char = build_char_tokenizer()
    (tiny,), _ = datasets.prompt_records([record], char, DatasetConfig())
    assert tiny.prompt_ids == char.encode("Q: 1+2=?", add_special_tokens=False)
    kept, skipped = datasets.prompt_records([record, {**record, "prompt": "x" * 50}], char, DatasetConfig(), 20)
    assert [p.qid for p in kept] == ["a"] and skipped == 1
