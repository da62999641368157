"""PySpark jobs around twophase pipelines (``docs/spark.md``).

* :mod:`twophase.jobs.orders` -- a Structured Streaming job: raw order events are parsed, enriched with EUR
  rates and totalled per customer in one-minute event-time windows with a watermark, then written
  through Spark's Kafka sink into a pipeline's source topic, keyed for upserts.
* :mod:`twophase.jobs.orders_writer` -- the orders stream written straight into a pipeline's sinks by the
  coordinated ``foreachBatch`` writer (:mod:`twophase.participants.spark`).
* :mod:`twophase.jobs.read_iceberg` -- reads the iceberg sink's tables through Iceberg's JdbcCatalog
  on the sink's own catalog: count, per-column checksums, rows, of one snapshot.
* :mod:`harness.spark_demo` -- :func:`harness.spark_demo.run_spark_demo`, both of the above on the local stack,
  verified sink by sink.
"""
