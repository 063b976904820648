"""A model's EOS ids read from its directory (no weights loaded)."""

from __future__ import annotations

import json
import types

from realrl.impl.generation.eos import eos_token_ids_in_dir
from realrl.impl.tiny_model import build_char_tokenizer
from tests.impl.conftest import EOS_ID


def write_json(path, data: dict) -> None:
    path.write_text(json.dumps(data))


def test_config_files_ints_lists_and_nulls_merge(tmp_path):
    write_json(tmp_path / "config.json", {"eos_token_id": 7})
    write_json(tmp_path / "generation_config.json", {"eos_token_id": [7, 9, 12]})
    assert eos_token_ids_in_dir(str(tmp_path)) == {7, 9, 12}
    write_json(tmp_path / "config.json", {"eos_token_id": None})
    write_json(tmp_path / "generation_config.json", {"bos_token_id": 0})
    assert eos_token_ids_in_dir(str(tmp_path)) == frozenset()
    assert eos_token_ids_in_dir(str(tmp_path), types.SimpleNamespace(eos_token_id=3)) == {3}


def test_saved_model_and_its_tokenizer(tiny_llama_dir, tmp_path):
    assert eos_token_ids_in_dir(tiny_llama_dir) == {EOS_ID}  # no tokenizer in that directory
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(str(tmp_path))
    write_json(tmp_path / "config.json", {"eos_token_id": 50})
    # the directory's tokenizer is loaded when none is given
    assert eos_token_ids_in_dir(str(tmp_path)) == {50, tokenizer.eos_token_id}
    assert eos_token_ids_in_dir(str(tmp_path), tokenizer) == {50, tokenizer.eos_token_id}
