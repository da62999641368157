"""A control topic the protocol cannot run on ends every process that reads it at start-up, in
one line naming ``control.topic`` and what is wrong, with status 2: more than one partition
(readers read partition 0, a pipeline's messages go where their key hashes, and coordinators
would each lead one), or compaction (every control message of a pipeline has the same key:
compaction would keep the last one and lose decisions). Never a process that runs on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from harness import Cluster
from tests.e2e.e2e_support import ends_in_one_line, scenario
from twophase.config import load_config
from twophase.kafka import create_topics


def _defective_control_topic(bootstrap: str, topic: str, defect: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    if defect == "partitions":
        admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[
            topic
        ].result(30)
    else:
        admin.create_topics(
            [
                NewTopic(
                    topic,
                    num_partitions=1,
                    replication_factor=1,
                    config={"cleanup.policy": "compact,delete"},
                )
            ]
        )[topic].result(30)


@pytest.mark.parametrize("defect", ["partitions", "compact"])
@pytest.mark.parametrize("role", ["coordinator", "participant"])
def test_a_control_topic_the_protocol_cannot_run_on_is_one_line_and_status_2(
    tmp_path: Path, role: str, defect: str
) -> None:
    s = scenario(
        tmp_path, f"ctl-{defect[:4]}", create=False, partitions=1, mongo=False, files=False
    )
    cfg = load_config(s.config_path)
    _defective_control_topic(s.bootstrap, cfg.control_topic, defect)
    create_topics(cfg)  # the others; the control topic stays as it was made
    c = Cluster(s)
    try:
        line = ends_in_one_line(c, role, {"TWOPHASE__METRICS__PORT": "0"}, "control.topic")
        want = "2 partitions" if defect == "partitions" else "cleanup.policy=compact,delete"
        assert want in line and cfg.control_topic in line, line
    finally:
        c.stop_all()
