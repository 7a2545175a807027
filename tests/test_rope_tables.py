"""Rope tables grow with the positions served (models/rope.py): a row made in a short table has the
bits it has in the whole one, for every rope type; a model's tables start at FIRST_ROWS and double as
a sequence passes their end, and the replies are those of tables made whole at load."""
import pytest

from engine_cases import run
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.kernels import reference
from tensorfold.models import rope
from tensorfold.models.config import RopeConfig, rope_inv_freq
from tensorfold.sampling.params import SamplingParams

ROPES = [RopeConfig(theta=10000.0), RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0,
                                                 original_max_position=8192),
         RopeConfig(theta=1e6, rope_type="yarn", factor=4.0, original_max_position=32768),
         RopeConfig(theta=1e6, rope_type="proportional", partial_rotary_factor=0.25)]


@pytest.mark.parametrize("config", ROPES, ids=lambda r: r.rope_type)
@pytest.mark.parametrize("head_dim", [64, 96, 512])
def test_a_row_has_the_same_bits_in_a_short_table_and_the_whole_one(config, head_dim):
    inv_freq, scale = rope_inv_freq(config, head_dim)
    whole = reference.rope_table(inv_freq, scale, 40_000)
    for rows in (1, 3, 4097, 12_345):
        part = reference.rope_table(inv_freq, scale, rows)
        assert whole[0][:rows].equal(part[0]) and whole[1][:rows].equal(part[1]), rows


def test_a_table_doubles_to_cover_the_positions_and_stops_at_max_position():
    table = rope.RopeTable(RopeConfig(theta=10000.0), 64, 10_000, "cpu")
    assert table.cos.shape == (rope.FIRST_ROWS, 64)
    table.cover(rope.FIRST_ROWS)
    assert table.cos.shape[0] == rope.FIRST_ROWS
    table.cover(rope.FIRST_ROWS + 1)
    assert table.cos.shape[0] == 2 * rope.FIRST_ROWS
    table.cover(9_000)
    assert table.cos.shape[0] == 10_000  # never past max_position
    whole = reference.rope_table(table.inv_freq, table.scale, 10_000)
    assert table.cos.equal(whole[0]) and table.sin.equal(whole[1])


def test_replies_past_the_first_rows_equal_those_of_whole_tables(tiny_llama, monkeypatch):
    """A 300-token prompt and 40 tokens on tables made with 16 rows (grown to the prefill's 300
    rows, then doubled at the first decode row, up to max_position) == on tables made whole: the
    same tokens, greedy and sampled."""
    prompts = [list(range(1, 301)), [7, 8, 9] * 30]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True)]
    config = EngineConfig(max_num_seqs=2, kv_cache_gib=0.02, probe=False)
    monkeypatch.setattr(rope, "FIRST_ROWS", 1 << 30)
    whole = Engine(tiny_llama, config)
    assert all(t.cos.shape[0] == t.max_position for t in whole.backend.model.rope_tables)
    expected = [r.output_ids for r in run(whole, prompts, params)]
    monkeypatch.setattr(rope, "FIRST_ROWS", 16)
    grown = Engine(tiny_llama, config)
    assert {t.cos.shape[0] for t in grown.backend.model.rope_tables} == {16}
    assert [r.output_ids for r in run(grown, prompts, params)] == expected
    assert {t.cos.shape[0] for t in grown.backend.model.rope_tables} == {min(600, t.max_position)
                                                                          for t in grown.backend.model.rope_tables}
