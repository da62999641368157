"""``twophase init``: a starter pipeline.yaml for the local stack (``make stack-up``).

The file is written as text, not dumped from a dict, so it keeps the comments that tell a
newcomer what each part is for and where every other option is documented (docs/config.md).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

__all__ = ["STACK_ENV_KEYS", "find_stack_env", "read_stack_env", "starter_pipeline"]

#: What the starter needs from ``stack.env`` (written by ``stack/stack.sh up``).
STACK_ENV_KEYS = ("TWOPHASE_KAFKA_BOOTSTRAP", "TWOPHASE_PG_DSN", "TWOPHASE_MONGO_URI")


def find_stack_env(explicit: str | None = None) -> Path:
    """``--stack-env``, else ``$TWOPHASE_STACK_DIR/stack.env``, else ``./.stack/stack.env``."""
    if explicit:
        return Path(explicit)
    stack_dir = os.environ.get("TWOPHASE_STACK_DIR") or str(Path.cwd() / ".stack")
    return Path(stack_dir) / "stack.env"


def read_stack_env(path: Path) -> dict[str, str]:
    """``KEY='value'`` lines as stack.sh writes them; raises ValueError naming what is missing."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(
            f"{path}: {exc.strerror}; start the local stack with `make stack-up` "
            "(or point --stack-env / TWOPHASE_STACK_DIR at its stack.env)"
        ) from None
    env: dict[str, str] = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            env[key.strip()] = value.strip().strip("'\"")
    missing = [k for k in STACK_ENV_KEYS if not env.get(k)]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}: run `make stack-up` again")
    return env


def _identifier(name: str) -> str:
    """A table / collection name from a pipeline name: lower case, letters, digits and _."""
    return re.sub(r"[^a-z0-9_]", "_", name.lower())


def starter_pipeline(name: str, env: dict[str, str], files_dir: Path, path: Path) -> str:
    """The starter ``path`` for pipeline ``name`` on the stack described by ``env``."""
    table = _identifier(name)
    # JSON strings are YAML strings: any path or address is quoted safely.
    q = json.dumps
    return f"""\
# A starter pipeline for the local stack, written by `twophase init`. Every option, with its
# default and bounds: docs/config.md. Next (README.md, "Your first pipeline"):
#   twophase validate {path}
#   twophase topics create {path}
#   twophase coordinator run {path}     # and, in another terminal:
#   twophase participant run {path}
#
# Records: JSON objects on the topic `{name}`, e.g. {{"id": 1, "customer": "c-1", "amount": 9.5}}.
# Each lands exactly once, all or nothing, in PostgreSQL, MongoDB and Parquet files.
pipeline: {name}
kafka:
  bootstrap_servers: {q(env["TWOPHASE_KAFKA_BOOTSTRAP"])}
control:
  # The local stack has one broker; production clusters keep the default of 3.
  replication_factor: 1
  # Set a key (the same for every process) to authenticate control messages, e.g.
  # hmac_key: ${{ENV:TWOPHASE_CONTROL_HMAC_KEY}}
sources:
  - topic: {name}
    partitions: 2
    replication_factor: 1
dead_letter:                  # records no sink can take, with the reason: {name}.dlq
  replication_factor: 1
commit:
  interval_ms: 1000           # one commit cycle per second
metrics:
  port: 0                     # a free port per process (several run on this machine)
sinks:
  - name: pg
    type: postgres
    dsn: {q(env["TWOPHASE_PG_DSN"])}
    table: {table}
    mode: upsert              # one row per id; a record sent again replaces it
    key: [id]
    create_table: {{id: bigint, customer: text, amount: "numeric(12,2)"}}
  - name: mongo
    type: mongodb
    uri: {q(env["TWOPHASE_MONGO_URI"])}
    database: twophase
    collection: {table}
    mode: upsert
    key: [id]
  - name: files
    type: files
    path: {q(str(files_dir))}
    format: parquet
"""
