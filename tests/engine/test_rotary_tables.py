"""A loaded model holds each distinct rotary cos/sin table once: its layers share equal
tables (Llama: one pair; Gemma 3: one per layer kind, whose rotary bases differ)."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.worker.models.layers import RotaryEmbedding
from tests.engine.tiny_models import save_hf_model


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("arch", "tables"), [("llama", 1), ("gemma3", 2)])
def test_layers_share_equal_rotary_tables(tmp_path, arch, tables) -> None:
    save_hf_model(arch, tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory=8 << 20, max_model_len=64)
    rotaries = [
        m for m in llm.engine.worker.runner.model.modules() if isinstance(m, RotaryEmbedding)
    ]
    assert len(rotaries) >= 2  # every layer has one
    assert len({m.cos.data_ptr() for m in rotaries}) == tables
    assert len({m.sin.data_ptr() for m in rotaries}) == tables
