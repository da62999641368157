"""PySpark jobs around twophase pipelines (``docs/spark.md``).

* :mod:`jobs.orders` -- a Structured Streaming job: raw order events are parsed, enriched with EUR
  rates and totalled per customer in one-minute event-time windows with a watermark, then written
  through Spark's Kafka sink into a pipeline's source topic, keyed for upserts.
* :mod:`jobs.orders_writer` -- the orders stream written straight into a pipeline's sinks by the
  coordinated ``foreachBatch`` writer (:mod:`participants.spark`).
* :mod:`jobs.demo` -- :func:`jobs.demo.run_spark_demo`, both of the above on the local stack,
  verified sink by sink.
"""
