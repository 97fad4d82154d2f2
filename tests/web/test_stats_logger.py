"""The periodic stats line: vLLM's wording, throughput over the interval, and silence
while nothing happens (a clock of our own and `tick()`: no sleeping)."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from engine.core.stats import EngineStats
from web.server_config import ServerConfig
from web.stats_logger import StatsLogger

IDLE = EngineStats(
    num_blocks=100,
    num_used_blocks=0,
    num_free_blocks=100,
    kv_slot_utilization=1.0,
    mean_kv_slot_utilization=1.0,
    num_preemptions=0,
    num_steps=0,
    num_running=0,
    num_waiting=0,
)


class Feed:
    """What the logger reads: engine stats, token totals and the time, set by the test."""

    def __init__(self) -> None:
        self.stats, self.prompt, self.generated, self.now = IDLE, 0, 0, 100.0

    def logger(self) -> StatsLogger:
        return StatsLogger(
            lambda: self.stats, lambda: (self.prompt, self.generated), 5.0, lambda: self.now
        )

    def advance(self, seconds: float, prompt: int = 0, generated: int = 0, **stats) -> None:
        self.now += seconds
        self.prompt += prompt
        self.generated += generated
        self.stats = dataclasses.replace(self.stats, **stats)


def test_a_busy_interval_logs_vllms_line_with_its_throughput(caplog):
    feed = Feed()
    stats_logger = feed.logger()
    feed.advance(
        5.0,
        prompt=100,
        generated=250,
        num_running=3,
        num_waiting=2,
        num_used_blocks=25,
        num_free_blocks=75,
        prefix_cache_queried_tokens=200,
        prefix_cache_hit_tokens=50,
    )
    with caplog.at_level(logging.INFO, logger="web.stats_logger"):
        line = stats_logger.tick()
    assert line == (
        "Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 50.0 tokens/s, "
        "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )
    assert [r.getMessage() for r in caplog.records] == [line]
    assert caplog.records[0].levelno == logging.INFO


def test_speculative_decoding_adds_the_intervals_acceptance():
    feed = Feed()
    stats_logger = feed.logger()
    spec = dict(
        spec_decode_num_drafts=10,
        spec_decode_num_draft_tokens=30,
        spec_decode_num_accepted_tokens=15,
        spec_decode_num_accepted_tokens_per_pos=(8, 5, 2),
    )
    feed.advance(5.0, generated=60, num_running=1, **spec)
    assert stats_logger.tick().endswith(
        ", Spec decode: mean acceptance length 2.50, acceptance rate 50.0%, "
        "per position 0.80, 0.50, 0.20"
    )
    spec = dict(
        spec_decode_num_drafts=20,
        spec_decode_num_draft_tokens=60,
        spec_decode_num_accepted_tokens=45,
        spec_decode_num_accepted_tokens_per_pos=(18, 15, 12),
    )
    feed.advance(5.0, generated=60, **spec)  # this interval alone: 10 drafts, 30 accepted
    assert stats_logger.tick().endswith(
        "mean acceptance length 4.00, acceptance rate 100.0%, per position 1.00, 1.00, 1.00"
    )
    feed.advance(5.0, generated=5)  # no verification in the interval: no spec part
    assert "Spec decode" not in stats_logger.tick()


def test_an_idle_server_stays_quiet_after_one_line_showing_the_drop_to_zero(caplog):
    feed = Feed()
    stats_logger = feed.logger()
    with caplog.at_level(logging.INFO, logger="web.stats_logger"):
        feed.advance(5.0)
        assert stats_logger.tick() is None  # idle from the start: nothing to say
        feed.advance(5.0, prompt=10, generated=40, num_running=1)
        assert "Running: 1 reqs" in stats_logger.tick()
        feed.advance(5.0, num_running=0)
        assert stats_logger.tick().startswith("Avg prompt throughput: 0.0 tokens/s")
        for _ in range(5):
            feed.advance(5.0)
            assert stats_logger.tick() is None
    assert len(caplog.records) == 2


def test_a_queue_change_without_tokens_is_logged():
    feed = Feed()
    stats_logger = feed.logger()
    feed.advance(5.0, num_waiting=4)  # requests queued, none scheduled yet
    assert "Waiting: 4 reqs" in stats_logger.tick()
    feed.advance(5.0)
    assert stats_logger.tick() is None


def test_the_interval_is_a_positive_number_of_seconds():
    assert ServerConfig("m").log_stats_interval_s == 5.0
    assert not ServerConfig("m").disable_log_stats
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="log_stats_interval_s"):
            ServerConfig("m", log_stats_interval_s=bad)
