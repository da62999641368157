"""``make bench``: every comparison in one invocation on the local stack, each figure the median
of ``--runs`` runs (at least three), written to ``bench/results/latest.json`` and drawn in
``bench/results/latest.png``. ``docs/benchmarks.md`` documents every field.

Sections (``--only`` picks some):

* ``throughput`` -- 1,000,000 ~200-byte JSON records on a 4-partition topic into PostgreSQL +
  Parquet files: exactly-once pipeline vs the same participants in ``at_least_once`` mode.
* ``ceiling``    -- the same rows by psycopg ``COPY`` straight into PostgreSQL (no Kafka) vs a
  PostgreSQL-only exactly-once pipeline.
* ``mongo``      -- a MongoDB-only pipeline vs ``insert_many`` of the same documents on the same
  server. The server here is SecantusDB (a test server, thousands of writes/s), not mongod.
* ``latency``    -- PREPARE->DECISION per cycle at a 1 s interval with 1, 2, 4, 8, 16
  participants.
* ``spark``      -- the coordinated ``foreachBatch`` writer vs plain ``foreachPartition`` +
  psycopg COPY of the same rows, and vs Delta Lake's idempotent ``foreachBatch`` appends
  (``txnAppId`` / ``txnVersion``) (:mod:`bench.spark_writer`, in its own process).
* ``avro``       -- the same records in Avro through the schema registry vs as JSON, each read
  by a PostgreSQL-only exactly-once pipeline (:mod:`bench.avro`).
* ``cdc``        -- Debezium change events of three tables (40% creates, 50% updates, 10%
  deletes) through one topic_pattern into PostgreSQL replica tables (table template, upsert)
  vs as many plain JSON inserts into one table, and vs Debezium's JDBC sink applying the same
  change events on the stack's Kafka Connect worker (:mod:`bench.cdc`).
* ``iceberg``    -- the exactly-once pipeline into an Iceberg table vs pyiceberg's own
  ``append`` of the same rows as Arrow, and vs Iceberg's Kafka Connect sink on the same records
  (:mod:`bench.iceberg_kc`); the pipeline's commit latency p99 (:mod:`bench.iceberg`).
* ``peers``      -- what users run today, on the stack's Kafka Connect worker: the PostgreSQL-only
  pipeline vs Debezium's JDBC sink (upsert) and the MongoDB-only pipeline vs MongoDB's Kafka
  sink (:mod:`bench.kc_peers`; the jars: ``bench/peers/README.md``).
* ``flink``      -- the PostgreSQL-only pipeline vs Flink 2.0's exactly-once JDBC (XA) sink on a
  local MiniCluster, a Kafka source on the same records, upserting into the same PostgreSQL
  (:mod:`bench.flink_peer`; the job and its jars: ``bench/peers/flink/``).

Runs of the two sides of a comparison alternate, so a noisy neighbour hurts both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import avro as avro_bench
from bench import cdc as cdc_bench
from bench import flink_peer, iceberg_kc, kc_peers
from bench import iceberg as iceberg_bench
from bench import latency as lat
from bench import throughput as tp
from harness import load_stack_env

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = (
    "throughput", "ceiling", "mongo", "latency", "spark", "avro", "cdc", "iceberg", "peers",
    "flink",
)  # fmt: skip
TARGETS = {
    "eo_over_alo": (">=", 0.9),
    "pg_pipeline_over_copy": (">=", 0.8),
    "pg_files_over_pg": (">=", 0.8),
    "mongo_over_direct": (">=", 0.3),
    "participant_rss_peak_mb": ("<=", 300),
    "commit_latency_p99_ms_at_8": ("<=", 60),
    "commit_latency_p99_ms_at_16": ("<=", 100),
    "spark_ratio": (">=", 0.8),
    "avro_over_json": (">=", 0.8),
    "cdc_over_plain": (">=", 0.5),
    "iceberg_over_append": (">=", 0.7),
    "iceberg_commit_p99_ms": ("<=", 500),
    # Against the connectors' rate from every partition assigned (the pipeline's clock starts
    # at a participant ready, past its group join): the stricter of the two timings.
    "spark_over_delta": (">=", 0.9),
    "eo_over_kc_jdbc_from_assigned": (">=", 3),
    "mongo_over_kc_mongo_from_assigned": (">=", 1),
}
MONGO_NOTE = (
    "MongoDB figures are measured on SecantusDB 0.7.0b3 (a MongoDB-protocol test server on "
    "WiredTiger, thousands of writes per second), not on mongod: only the ratio means anything"
)


def say(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def alternate(runs: int, sides: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(runs):
        for name, fn in sides.items():
            value = fn()
            out[name].append(value)
            say(f"  run {i + 1}/{runs} {name}: {value:,.0f}")
    return out


def throughput(args: argparse.Namespace, env: dict[str, str], work: Path) -> dict[str, Any]:
    say(f"throughput: producing {args.records:,} records")
    source = tp.Source.create(env["TWOPHASE_KAFKA_BOOTSTRAP"], args.records, "tput")
    details: dict[str, list[dict[str, Any]]] = {
        "exactly_once": [],
        "at_least_once": [],
        "pg_only": [],
    }

    def side(name: str, mode: str, sinks: set[str]) -> Callable[[], float]:
        def run() -> float:
            r = tp.pipeline_run(source, work, mode=mode, sinks=sinks)
            details[name].append(r.asdict())
            return r.records_per_s

        return run

    try:
        # The PostgreSQL-only pipeline alternates with the PG + files ones: pg_files_over_pg
        # compares runs of one series, as every ratio here does.
        got = alternate(
            args.runs,
            {
                "exactly_once": side("exactly_once", "exactly_once", {"pg", "files"}),
                "at_least_once": side("at_least_once", "at_least_once", {"pg", "files"}),
                "pg_only": side("pg_only", "exactly_once", {"pg"}),
            },
        )
    finally:
        source.delete()
    eo, alo = median(got["exactly_once"]), median(got["at_least_once"])
    pg = median(got["pg_only"])
    return {
        **rss_peaks("eo", details["exactly_once"]),
        "eo_records_per_s": round(eo),
        "alo_records_per_s": round(alo),
        "eo_over_alo": round(eo / alo, 3),
        "pg_only_records_per_s": round(pg),
        "pg_files_over_pg": round(eo / pg, 3),
        "_runs": details,
    }


def direct_vs_pipeline(
    env: dict[str, str],
    work: Path,
    *,
    runs: int,
    records: int,
    sink: str,
    direct: Callable[[list[dict[str, Any]]], float],
) -> tuple[float, float, dict[str, Any]]:
    """Median rates of writing the records straight into a store vs a ``sink``-only pipeline."""
    say(f"{sink}: producing {records:,} records")
    source = tp.Source.create(env["TWOPHASE_KAFKA_BOOTSTRAP"], records, sink)
    details: list[dict[str, Any]] = []
    try:
        rows = tp.source_rows(source)

        def pipeline() -> float:
            r = tp.pipeline_run(source, work, mode="exactly_once", sinks={sink})
            details.append(r.asdict())
            return r.records_per_s

        got = alternate(runs, {"direct": lambda: direct(rows), "pipeline": pipeline})
    finally:
        source.delete()
    runs_out = {"direct": [round(x) for x in got["direct"]], "pipeline": details}
    return median(got["direct"]), median(got["pipeline"]), runs_out


def rss_peaks(prefix: str, runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """The highest peak resident memory (MB) of any participant, and of any coordinator, over
    ``runs`` (each with the ``rss_peak_mb`` of its processes)."""
    peaks: dict[str, list[float]] = {"participant": [], "coordinator": []}
    for run in runs:
        for proc, mb in run.get("rss_peak_mb", {}).items():
            peaks["coordinator" if proc.startswith("coord") else "participant"].append(mb)
    return {f"{prefix}_{k}_rss_peak_mb": max(v) if v else None for k, v in peaks.items()}


def ceiling(args: argparse.Namespace, env: dict[str, str], work: Path) -> dict[str, Any]:
    dsn = env["TWOPHASE_PG_DSN"]
    copy, pipe, runs = direct_vs_pipeline(
        env,
        work,
        runs=args.runs,
        records=args.records,
        sink="pg",
        direct=lambda rows: tp.pg_copy_run(dsn, rows),
    )
    steady = [r["control"].get("steady_records_per_s") for r in runs["pipeline"]]
    steady_rates = [float(x) for x in steady if x]
    return {
        **rss_peaks("pg_pipeline", runs["pipeline"]),
        "pg_copy_records_per_s": round(copy),
        "pg_pipeline_records_per_s": round(pipe),
        "pg_pipeline_over_copy": round(pipe / copy, 3),
        # Diagnostic, not the target: the pipeline's rate between commits, without the start
        # and the final cycle (see the README).
        "pg_pipeline_steady_records_per_s": round(median(steady_rates)) if steady_rates else None,
        "_runs": runs,
    }


def mongo(args: argparse.Namespace, env: dict[str, str], work: Path) -> dict[str, Any]:
    uri = env["TWOPHASE_MONGO_URI"]
    direct, pipe, runs = direct_vs_pipeline(
        env,
        work,
        runs=args.runs,
        records=args.mongo_records,
        sink="mongo",
        direct=lambda rows: tp.mongo_direct_run(uri, rows),
    )
    return {
        "mongo_direct_records_per_s": round(direct),
        "mongo_pipeline_records_per_s": round(pipe),
        "mongo_over_direct": round(pipe / direct, 3),
        "mongo_note": MONGO_NOTE,
        "_runs": runs,
    }


def latency(args: argparse.Namespace, env: dict[str, str], work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in args.participants:
        runs = []
        for i in range(args.runs):
            r = lat.latency_run(
                env["TWOPHASE_KAFKA_BOOTSTRAP"], work, n, cycles=args.latency_cycles
            )
            say(f"  latency {n} participants, run {i + 1}/{args.runs}: {r.asdict()}")
            runs.append(r)
        out[str(n)] = lat.summarize(runs)
    return {"commit_latency_ms": out}


def spark(args: argparse.Namespace, _env: dict[str, str], work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    result = work / "spark.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.spark_writer",
        "--rows",
        str(args.spark_rows),
        "--rounds",
        str(args.runs),
        "--json",
        str(result),
    ]
    say("spark: " + " ".join(cmd[1:]))
    subprocess.run(cmd, check=True)
    got = json.loads(result.read_text())
    coordinated = got["rows_per_s"]["coordinated"]
    plain = got["rows_per_s"]["plain-rows"]
    delta = got["rows_per_s"].get("delta")  # None when its side was left out (--sides)
    return {
        "spark_coordinated_rows_per_s": round(coordinated),
        "spark_plain_rows_per_s": round(plain),
        "spark_ratio": round(coordinated / plain, 3),
        "spark_delta_rows_per_s": round(delta) if delta else None,
        "spark_over_delta": round(coordinated / delta, 3) if delta else None,
        "_runs": got["runs"],
    }


def avro(args: argparse.Namespace, env: dict[str, str], work: Path) -> dict[str, Any]:
    bootstrap = env["TWOPHASE_KAFKA_BOOTSTRAP"]
    say(f"avro: producing {args.records:,} records as JSON and as Avro")
    plain = tp.Source.create(bootstrap, args.records, "avrojson")
    framed = avro_bench.avro_source(bootstrap, env["TWOPHASE_SCHEMA_REGISTRY_URL"], args.records)
    details: dict[str, list[dict[str, Any]]] = {"avro": [], "json": []}

    def side(name: str, source: tp.Source) -> Callable[[], float]:
        def run() -> float:
            r = tp.pipeline_run(source, work, mode="exactly_once", sinks={"pg"})
            details[name].append(r.asdict())
            return r.records_per_s

        return run

    try:
        got = alternate(args.runs, {"avro": side("avro", framed), "json": side("json", plain)})
    finally:
        plain.delete()
        framed.delete()
    a, j = median(got["avro"]), median(got["json"])
    return {
        "avro_records_per_s": round(a),
        "avro_json_records_per_s": round(j),
        "avro_over_json": round(a / j, 3),
        "_runs": details,
    }


def cdc(args: argparse.Namespace, env: dict[str, str], work: Path) -> dict[str, Any]:
    bootstrap = env["TWOPHASE_KAFKA_BOOTSTRAP"]
    say(f"cdc: producing {args.cdc_events:,} change events and as many plain records")
    changes = cdc_bench.Changes.create(bootstrap, args.cdc_events)
    plain = cdc_bench.plain_source(bootstrap, changes.messages)
    framed = cdc_bench.enveloped_changes(changes)
    details: dict[str, list[dict[str, Any]]] = {"cdc": [], "plain": [], "kafka_connect": []}

    def run_cdc() -> float:
        r = cdc_bench.cdc_run(changes, work)
        details["cdc"].append(r.asdict())
        return r.records_per_s

    def run_plain() -> float:
        r = tp.pipeline_run(plain, work, mode="exactly_once", sinks={"pg"})
        details["plain"].append(r.asdict())
        return r.records_per_s

    def run_kc() -> float:
        r = cdc_bench.kc_cdc_run(framed, work)
        details["kafka_connect"].append(r.asdict())
        return r.records_per_s

    try:
        got = alternate(args.runs, {"cdc": run_cdc, "plain": run_plain, "kafka_connect": run_kc})
    finally:
        changes.delete()
        plain.delete()
        framed.delete()
    c, p, k = median(got["cdc"]), median(got["plain"]), median(got["kafka_connect"])
    k_assigned = kc_peers._median_from_assigned(details["kafka_connect"])
    return {
        "cdc_records_per_s": round(c),
        "cdc_plain_records_per_s": round(p),
        "cdc_over_plain": round(c / p, 3),
        # Debezium's JDBC sink applying the same change events (at least once).
        "cdc_kc_jdbc_records_per_s": round(k),
        "cdc_over_kc_jdbc": round(c / k, 2),
        "cdc_over_kc_jdbc_from_assigned": round(c / k_assigned, 2) if k_assigned else None,
        "_runs": details,
    }


def iceberg(args: argparse.Namespace, env: dict[str, str], work: Path) -> dict[str, Any]:
    say(f"iceberg: producing {args.records:,} records")
    source = tp.Source.create(env["TWOPHASE_KAFKA_BOOTSTRAP"], args.records, "iceberg")
    details: dict[str, list[dict[str, Any]]] = {"pipeline": [], "kafka_connect": []}
    try:
        data = iceberg_bench.arrow_of(source, work)

        def run_pipeline() -> float:
            r = iceberg_bench.pipeline_run(source, work)
            details["pipeline"].append(r.asdict())
            return r.records_per_s

        def run_kc() -> float:
            r = iceberg_kc.kc_run(source, work)
            details["kafka_connect"].append(r.asdict())
            return r.records_per_s

        got = alternate(
            args.runs,
            {
                "pipeline": run_pipeline,
                "append": lambda: iceberg_bench.direct_run(data, work, source),
                "kafka_connect": run_kc,
            },
        )
    finally:
        source.delete()
    p, d, k = median(got["pipeline"]), median(got["append"]), median(got["kafka_connect"])
    p99s = [r["control"]["commit_latency_ms"]["p99"] for r in details["pipeline"]]
    return {
        "iceberg_pipeline_records_per_s": round(p),
        "iceberg_append_records_per_s": round(d),
        "iceberg_over_append": round(p / d, 3),
        "iceberg_commit_p99_ms": round(median(p99s)),
        "iceberg_kc_records_per_s": round(k),
        "iceberg_over_kc": round(p / k, 3),
        "_runs": {**details, "append": got["append"]},
    }


def targets(res: dict[str, Any]) -> dict[str, Any]:
    values = {
        "eo_over_alo": res.get("eo_over_alo"),
        "pg_pipeline_over_copy": res.get("pg_pipeline_over_copy"),
        "pg_files_over_pg": res.get("pg_files_over_pg"),
        "mongo_over_direct": res.get("mongo_over_direct"),
        "participant_rss_peak_mb": max(
            (v for k, v in res.items() if k.endswith("participant_rss_peak_mb") and v),
            default=None,
        ),
        "commit_latency_p99_ms_at_8": res.get("commit_latency_ms", {}).get("8", {}).get("p99"),
        "commit_latency_p99_ms_at_16": res.get("commit_latency_ms", {}).get("16", {}).get("p99"),
        "spark_ratio": res.get("spark_ratio"),
        "avro_over_json": res.get("avro_over_json"),
        "cdc_over_plain": res.get("cdc_over_plain"),
        "iceberg_over_append": res.get("iceberg_over_append"),
        "iceberg_commit_p99_ms": res.get("iceberg_commit_p99_ms"),
        "spark_over_delta": res.get("spark_over_delta"),
        "eo_over_kc_jdbc_from_assigned": res.get("eo_over_kc_jdbc_from_assigned"),
        "mongo_over_kc_mongo_from_assigned": res.get("mongo_over_kc_mongo_from_assigned"),
    }
    out = {}
    for name, (op, bound) in TARGETS.items():
        v = values[name]
        met = None if v is None else (v >= bound if op == ">=" else v <= bound)
        out[name] = {"value": v, "target": f"{op} {bound}", "met": met}
    return out


def chart(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    # A results file merged by section (each re-run on its own) says when its newest one ran.
    when = max([res["started"], *(res.get("sections_started") or {}).values()])
    fig.suptitle(f"twophase benchmarks (newest section {when}, {res['machine']['cpus']} CPUs)")

    ax = axes[0][0]
    bars = {
        "exactly-once\nPG+files": res.get("eo_records_per_s"),
        "at-least-once\nPG+files": res.get("alo_records_per_s"),
        "exactly-once\nPG only": res.get("pg_pipeline_records_per_s"),
        "psycopg COPY\n(no Kafka)": res.get("pg_copy_records_per_s"),
    }
    shown = {k: v for k, v in bars.items() if v}
    ax.bar(list(shown), list(shown.values()), color=["#2b6cb0", "#90cdf4", "#2f855a", "#9ae6b4"])
    ax.set_title("Pipeline throughput (records/s, median)")
    for i, v in enumerate(shown.values()):
        ax.text(i, v, f"{v:,}", ha="center", va="bottom")

    ax = axes[0][1]
    values = {k: v["value"] for k, v in targets(res).items()}
    ratios = {
        "EO/ALO": "eo_over_alo",
        "PG/COPY": "pg_pipeline_over_copy",
        "PG+files\n/PG": "pg_files_over_pg",
        "Mongo*/\ndirect": "mongo_over_direct",
        "Avro/\nJSON": "avro_over_json",
        "CDC/\nplain": "cdc_over_plain",
        "Iceberg/\nappend": "iceberg_over_append",
        "Spark/\nplain": "spark_ratio",
        "Spark/\nDelta": "spark_over_delta",
    }
    names = [k for k, f in ratios.items() if values.get(f) is not None]
    vals = [float(values[ratios[k]]) for k in names]
    ax.bar(names, vals, color="#805ad5")
    for i, k in enumerate(names):
        ax.hlines(TARGETS[ratios[k]][1], i - 0.4, i + 0.4, colors="red", linestyles="dashed")
        ax.text(i, vals[i], f"{vals[i]:.2f}", ha="center", va="bottom")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title("Ratios, same run (dashed: target; *SecantusDB test server)")

    ax = axes[1][0]
    cl = res.get("commit_latency_ms") or {}
    if cl:
        ns = sorted(cl, key=int)
        ax.plot([int(n) for n in ns], [cl[n]["p50"] for n in ns], "o-", label="p50")
        ax.plot([int(n) for n in ns], [cl[n]["p99"] for n in ns], "s-", label="p99")
        goals = [(n, TARGETS[f"commit_latency_p99_ms_at_{n}"][1]) for n in (8, 16)]
        ax.plot([n for n, _ in goals], [g for _, g in goals], "rx", ms=10, label="p99 target")
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(n) for n in ns], ns)
        ax.legend()
    ax.set_title("Commit latency PREPARE->DECISION (ms) by participants, 1 s interval")
    ax.set_xlabel("participants")

    ax = axes[1][1]
    # twophase (exactly once) beside what users run today, on the same records in the same run.
    pairs = {
        "PG upsert /\nKC Debezium JDBC": (
            "kc_jdbc_pg_pipeline_records_per_s",
            "peer_kc_jdbc_records_per_s",
        ),
        "MongoDB* /\nKC MongoDB": (
            "kc_mongo_pipeline_records_per_s",
            "peer_kc_mongo_records_per_s",
        ),
        "CDC /\nKC Debezium JDBC": ("cdc_records_per_s", "cdc_kc_jdbc_records_per_s"),
        "Iceberg /\nIceberg KC": ("iceberg_pipeline_records_per_s", "iceberg_kc_records_per_s"),
        "Spark /\nDelta": ("spark_coordinated_rows_per_s", "spark_delta_rows_per_s"),
    }
    shown = {k: (res[a], res[b]) for k, (a, b) in pairs.items() if res.get(a) and res.get(b)}
    xs = list(range(len(shown)))
    ours = [a for a, _ in shown.values()]
    peers = [b for _, b in shown.values()]
    ax.bar([x - 0.2 for x in xs], ours, 0.4, color="#2f855a", label="twophase")
    ax.bar([x + 0.2 for x in xs], peers, 0.4, color="#a0aec0", label="peer")
    ax.set_yscale("log")
    ax.set_xticks(xs, list(shown), fontsize=8)
    for x, (a, b) in zip(xs, shown.values(), strict=True):
        ax.text(x, max(a, b) * 1.15, f"x{a / b:.2f}", ha="center", va="bottom")
    ax.set_ylim(top=max(ours + peers, default=1) * 4)
    ax.legend(loc="lower right")
    ax.set_title("twophase vs what users run today (records/s, log; *SecantusDB)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    ap.add_argument("--runs", type=int, default=3, help="runs per figure (median; >= 3)")
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--mongo-records", type=int, default=50_000)
    ap.add_argument(
        "--participants",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 2, 4, 8, 16],
        help="participant counts for the latency section",
    )
    ap.add_argument("--latency-cycles", type=int, default=20, help="cycles measured per run")
    ap.add_argument("--spark-rows", type=int, default=200_000)
    ap.add_argument("--cdc-events", type=int, default=1_000_000, help="change events (cdc)")
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument("--out", default=str(RESULTS / "latest.json"))
    args = ap.parse_args(argv)
    if args.runs < 3:
        ap.error("--runs must be at least 3: every figure is a median of three or more runs")
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")

    env = load_stack_env()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        },
    }
    runs: dict[str, Any] = {}
    started = time.monotonic()
    fns = {
        "throughput": throughput,
        "ceiling": ceiling,
        "mongo": mongo,
        "latency": latency,
        "spark": spark,
        "avro": avro,
        "cdc": cdc,
        "iceberg": iceberg,
        "peers": kc_peers.section,
        "flink": flink_peer.section,
    }
    with tempfile.TemporaryDirectory(prefix="twophase-bench-") as tmp:
        for name in sections:
            t0 = time.monotonic()
            got = fns[name](args, env, Path(tmp) / name)
            runs[name] = got.pop("_runs", None)
            res.update(got)
            say(f"{name} done in {time.monotonic() - t0:.0f}s: {json.dumps(got)}")
    res["targets"] = targets(res)
    res["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    res["seconds"] = round(time.monotonic() - started)
    res["runs"] = runs
    out.write_text(json.dumps(res, indent=2) + "\n")
    chart(res, out.with_suffix(".png"))
    summary = {k: v for k, v in res.items() if k not in ("runs", "args")}
    print(json.dumps(summary, indent=2))
    say(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
