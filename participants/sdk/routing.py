"""Target templates: one sink, a table (collection, ...) per topic or per field value.

A sink whose target name is a template -- ``${topic}``, ``${value.FIELD}``, ``${source.FIELD}``
-- writes each record into the target the template names for it (``docs/cdc.md``).
``${topic}`` is the record's topic after an optional ``topic_replace`` (``[pattern,
replacement]``, applied with ``re.sub``: Kafka Connect's RegexRouter); ``${value.FIELD}`` is a
scalar field of the record's value; ``${source.FIELD}`` a field of where the change came from
(:attr:`Record.source`: Debezium's ``source`` block, e.g. ``${source.table}``), which a delete
carries as well as a write.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from twophase.participants.sdk.records import Record, Rejected

__all__ = ["TargetTemplate", "check_template", "check_topic_replace", "is_template"]

#: A placeholder of a template.
_PLACEHOLDER = re.compile(r"\$\{(topic|(?:value|source)\.[^{}]+)\}")


def is_template(name: str) -> bool:
    return "${" in name


def check_template(value: str) -> str:
    """``value`` when its placeholders are known ones; ValueError naming the problem (for a
    config model's validator)."""
    rest = _PLACEHOLDER.sub("", value)
    if "${" in rest or "}" in rest:
        raise ValueError(
            f"{value!r}: a template knows ${{topic}}, ${{value.FIELD}} and ${{source.FIELD}} only"
        )
    return value


def check_topic_replace(value: tuple[str, str] | None, template: str) -> tuple[str, str] | None:
    """A ``topic_replace`` setting: only with a template naming ``${topic}``, a valid regex."""
    if value is None:
        return None
    if "${topic}" not in template:
        raise ValueError("used only with a template naming ${topic}")
    try:
        re.compile(value[0])
    except re.error as exc:
        raise ValueError(f"{value[0]!r} is not a regular expression: {exc}") from None
    return value


@dataclass
class TargetTemplate:
    """Renders a template for a record: the target's name, or why there is none."""

    template: str
    topic_replace: tuple[str, str] | None = None
    _by_topic: dict[str, str] = field(default_factory=dict)

    @property
    def topic_only(self) -> bool:
        """Whether the name depends on the topic alone (cached per topic then)."""
        return "${value." not in self.template and "${source." not in self.template

    def for_topic(self, topic: str) -> str:
        """The target of every record of ``topic``, for a template of the topic alone."""
        assert self.topic_only
        known = self._by_topic.get(topic)
        if known is None:
            got = self.render(Record(topic, 0, 0, -1, None, {}))
            assert isinstance(got, str)  # ${topic} always has a value
            known = got
        return known

    def render(self, record: Record) -> str | Rejected:
        """The target of ``record``, or a rejection saying why it has none."""
        if self.topic_only and (known := self._by_topic.get(record.topic)) is not None:
            return known
        missing: list[str] = []

        def fill(m: re.Match[str]) -> str:
            name = m.group(1)
            if name == "topic":
                topic = record.topic
                if self.topic_replace is not None:
                    topic = re.sub(self.topic_replace[0], self.topic_replace[1], topic)
                return topic
            if name.startswith("source."):
                value = (record.source or {}).get(name[len("source.") :])
            else:
                value = record.value.get(name[len("value.") :])
            if value is None or isinstance(value, dict | list):
                missing.append(name)
                return ""
            return str(value)

        name = _PLACEHOLDER.sub(fill, self.template)
        if missing:
            return Rejected(record, f"target {self.template}: no value for ${{{missing[0]}}}")
        if self.topic_only:
            self._by_topic[record.topic] = name
        return name
