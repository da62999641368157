"""The source topics a participant's consumer subscribes to.

Named topics (``sources[].topic``) are subscribed as they are. With a ``topic_pattern`` the
participant reads the broker's topic list itself, every ``TOPIC_REFRESH_S``, and subscribes to
the explicit list of matching topics: a new topic changes the list, which makes the group
rebalance, and the next assignment says which topics it was built on -- the votes carry them, so
the coordinator's coverage rule knows which partitions this generation must cover
(``control-topic/PROTOCOL.md``, "Coverage"). librdkafka's own regex subscription would find new
topics too, but would not say which ones an assignment was built on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaException

from twophase.config import PipelineConfig
from twophase.kafka import TOPIC_REFRESH_S

__all__ = ["Subscription"]

log = logging.getLogger("twophase.participant")

#: How long one read of the topic list may take on the data thread; a broker that does not
#: answer keeps the current list until the next refresh.
LIST_TIMEOUT_S = 5.0


class Subscription:
    def __init__(
        self,
        cfg: PipelineConfig,
        consumer: Consumer,
        on_assign: Callable[..., None],
        on_revoke: Callable[..., None],
    ) -> None:
        self.cfg = cfg
        self.consumer = consumer
        self._callbacks = {"on_assign": on_assign, "on_revoke": on_revoke}
        self.topics: tuple[str, ...] = ()
        self._next = 0.0

    def start(self) -> None:
        """Subscribe: the named topics, and those the patterns match now."""
        if not self.cfg.has_topic_patterns:
            self._subscribe(tuple(self.cfg.source_topics))
            return
        self._next = 0.0
        self.refresh()

    def refresh(self) -> None:
        """With patterns, every ``TOPIC_REFRESH_S``: re-read the topic list and subscribe again
        when it changed (the group rebalances)."""
        if not self.cfg.has_topic_patterns or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + TOPIC_REFRESH_S
        try:
            existing = self.consumer.list_topics(timeout=LIST_TIMEOUT_S).topics
        except KafkaException as exc:
            log.warning("cannot read the topic list (keeping %s): %s", self.topics, exc)
            return
        found = tuple(self.cfg.resolve_topics(existing))
        if found != self.topics:
            self._subscribe(found)

    def _subscribe(self, topics: tuple[str, ...]) -> None:
        added, gone = sorted(set(topics) - set(self.topics)), sorted(set(self.topics) - set(topics))
        log.info("source topics: %s (new: %s, gone: %s)", topics or "none", added, gone)
        self.topics = topics
        if topics:
            self.consumer.subscribe(list(topics), **self._callbacks)
        else:
            self.consumer.unsubscribe()  # nothing matches yet: no assignment, no votes
