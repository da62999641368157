"""The participant process: drives :class:`~twophase.participants.machine.ParticipantMachine` with Kafka and
the configured sinks, on two threads.

* The **data thread** owns the source consumer and the open part: it consumes batches, decodes
  them, writes them into every sink, and prepares the part when the coordinator asks.
* The **control thread** owns the control-topic reader: it feeds every control message to the
  machine and applies decisions (commit/abort of prepared parts) in log order. Decisions never
  wait for the data thread, so a write blocked on a lock held by a prepared part cannot deadlock
  with the decision that releases it.

Both feed one machine under one lock. Actions for the other thread travel through a queue.
"""

from twophase.participants.runtime.atleastonce import AtLeastOnceRuntime
from twophase.participants.runtime.participant import ParticipantRuntime

__all__ = ["AtLeastOnceRuntime", "ParticipantRuntime"]
