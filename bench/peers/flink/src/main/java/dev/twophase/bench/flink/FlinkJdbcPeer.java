package dev.twophase.bench.flink;

import java.math.BigDecimal;
import java.sql.PreparedStatement;
import java.sql.SQLException;
import java.sql.Types;
import java.time.Duration;

import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.functions.RichMapFunction;
import org.apache.flink.api.common.serialization.SimpleStringSchema;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.PipelineOptionsInternal;
import org.apache.flink.configuration.RestOptions;
import org.apache.flink.configuration.RestartStrategyOptions;
import org.apache.flink.connector.jdbc.JdbcExactlyOnceOptions;
import org.apache.flink.connector.jdbc.JdbcExecutionOptions;
import org.apache.flink.connector.jdbc.core.datastream.sink.JdbcSink;
import org.apache.flink.connector.kafka.source.KafkaSource;
import org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer;
import org.apache.flink.core.execution.CheckpointingMode;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.DeserializationFeature;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.JsonNode;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.ObjectMapper;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.postgresql.xa.PGXADataSource;

/**
 * The Flink peer of twophase's PostgreSQL-only pipeline (bench/flink_peer.py): a Kafka topic of
 * the bench's JSON orders, read from the earliest offsets, upserted by {@code id} into a
 * PostgreSQL table by Flink's exactly-once JDBC sink (XA: every checkpoint prepares one
 * PostgreSQL transaction per subtask; connector 4.0.0-2.0 commits it right after, while the
 * checkpoint is still being taken -- bench/peers/README.md), on a MiniCluster in this JVM.
 *
 * <p>Arguments: {@code bootstrap topic jdbc-url user table partitions job-id batch-size
 * checkpoint-ms}; the password in {@code $PGPASSWORD} (libpq's name for it), not on the command
 * line where any {@code ps} shows it. Parallelism = the topic's partitions (one source reader and one
 * sink writer per partition, as the pipeline has one consumer per partition). The job never
 * ends by itself (a streaming source, like the pipeline's); the bench stops the JVM once the
 * table holds every record.
 *
 * <p>Stdout carries the bench's clock marks, one line each, everything else goes to the log:
 * {@code OPEN <subtask>} when a subtask's operators are open (the task about to run),
 * {@code FIRST <subtask>} at its first record, {@code SUBMITTED <job-id>} once the job is
 * accepted.
 */
public final class FlinkJdbcPeer {

    private FlinkJdbcPeer() {}

    public static void main(String[] args) throws Exception {
        if (args.length != 9) {
            System.err.println(
                    "usage: PGPASSWORD=... FlinkJdbcPeer bootstrap topic jdbc-url user table"
                            + " partitions job-id batch-size checkpoint-ms");
            System.exit(2);
        }
        final String bootstrap = args[0];
        final String topic = args[1];
        final String url = args[2];
        final String user = args[3];
        final String password = System.getenv().getOrDefault("PGPASSWORD", "");
        final String table = args[4];
        final int partitions = Integer.parseInt(args[5]);
        final String jobId = args[6];
        final int batchSize = Integer.parseInt(args[7]);
        final long checkpointMs = Long.parseLong(args[8]);

        Configuration conf = new Configuration();
        // A fixed job id: the XA transaction ids embed it, so the bench can find (and roll back)
        // whatever this run leaves prepared when it is stopped.
        conf.set(PipelineOptionsInternal.PIPELINE_FIXED_JOB_ID, jobId);
        // The MiniCluster's REST endpoint on any free loopback port (the default is 8081).
        conf.set(RestOptions.BIND_ADDRESS, "127.0.0.1");
        conf.set(RestOptions.ADDRESS, "127.0.0.1");
        conf.set(RestOptions.BIND_PORT, "0");
        // A failure ends the run (the bench sees the JVM exit) instead of restarting quietly.
        conf.set(RestartStrategyOptions.RESTART_STRATEGY, "none");
        conf.set(CheckpointingOptions.CHECKPOINTING_INTERVAL, Duration.ofMillis(checkpointMs));
        conf.set(CheckpointingOptions.CHECKPOINTING_CONSISTENCY_MODE, CheckpointingMode.EXACTLY_ONCE);

        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.setParallelism(partitions);

        KafkaSource<String> source =
                KafkaSource.<String>builder()
                        .setBootstrapServers(bootstrap)
                        .setTopics(topic)
                        .setGroupId("flink-" + table)
                        .setStartingOffsets(OffsetsInitializer.earliest())
                        .setValueOnlyDeserializer(new SimpleStringSchema())
                        // Read only what producers committed, as the pipeline's consumers do.
                        .setProperty("isolation.level", "read_committed")
                        .build();

        String sql =
                "INSERT INTO "
                        + table
                        + " (id, customer, amount, currency, ts, note)"
                        + " VALUES (?, ?, ?, ?, ?::timestamptz, ?)"
                        + " ON CONFLICT (id) DO UPDATE SET customer = EXCLUDED.customer,"
                        + " amount = EXCLUDED.amount, currency = EXCLUDED.currency,"
                        + " ts = EXCLUDED.ts, note = EXCLUDED.note";

        env.fromSource(source, WatermarkStrategy.noWatermarks(), "kafka")
                .map(new Parse())
                .name("parse")
                .sinkTo(
                        JdbcSink.<Order>builder()
                                .withQueryStatement(sql, FlinkJdbcPeer::bind)
                                .withExecutionOptions(
                                        JdbcExecutionOptions.builder()
                                                .withBatchSize(batchSize)
                                                // The XA sink refuses retries: a retried batch
                                                // could be written twice (FLINK-22311).
                                                .withMaxRetries(0)
                                                .build())
                                .buildExactlyOnce(
                                        JdbcExactlyOnceOptions.builder()
                                                // The connector's docs ask for this where a
                                                // connection holds one XA transaction at a
                                                // time, "e.g. PostgreSQL, MySQL".
                                                .withTransactionPerConnection(true)
                                                .build(),
                                        () -> dataSource(url, user, password)))
                .name("jdbc-xa");

        JobClient job = env.executeAsync("twophase-bench-flink-" + table);
        System.out.println("SUBMITTED " + job.getJobID());
        System.out.flush();
        // Until the bench stops the JVM, or the job fails (restart strategy none): then exit
        // non-zero with the cause on stderr.
        try {
            job.getJobExecutionResult().get();
        } catch (Exception e) {
            e.printStackTrace();
            System.exit(1);
        }
        System.exit(0);
    }

    static PGXADataSource dataSource(String url, String user, String password) {
        PGXADataSource ds = new PGXADataSource();
        ds.setUrl(url);
        ds.setUser(user);
        ds.setPassword(password);
        return ds;
    }

    static void bind(PreparedStatement ps, Order o) throws SQLException {
        ps.setLong(1, o.id);
        setOrNull(ps, 2, o.customer, Types.VARCHAR);
        if (o.amount == null) {
            ps.setNull(3, Types.NUMERIC);
        } else {
            ps.setBigDecimal(3, o.amount);
        }
        setOrNull(ps, 4, o.currency, Types.VARCHAR);
        setOrNull(ps, 5, o.ts, Types.VARCHAR);
        setOrNull(ps, 6, o.note, Types.VARCHAR);
    }

    private static void setOrNull(PreparedStatement ps, int i, String v, int type)
            throws SQLException {
        if (v == null) {
            ps.setNull(i, type);
        } else {
            ps.setString(i, v);
        }
    }

    /** One order, as the pipeline's table holds it. A Flink POJO: no Kryo on the way. */
    public static final class Order {
        public long id;
        public String customer;
        public BigDecimal amount;
        public String currency;
        /** The ISO-8601 string as it is; PostgreSQL casts it ({@code ?::timestamptz}). */
        public String ts;
        public String note;

        public Order() {}
    }

    /** JSON text to an {@link Order}; prints the subtask's clock marks for the bench. */
    static final class Parse extends RichMapFunction<String, Order> {
        private transient ObjectMapper json;
        private transient boolean seen;
        private transient int subtask;

        @Override
        public void open(OpenContext context) {
            // Numbers with a fraction as BigDecimal: the amount exactly as written, as the
            // pipeline's sink reads it into numeric(12,2).
            json = new ObjectMapper().enable(DeserializationFeature.USE_BIG_DECIMAL_FOR_FLOATS);
            subtask = getRuntimeContext().getTaskInfo().getIndexOfThisSubtask();
            mark("OPEN " + subtask);
        }

        @Override
        public Order map(String value) throws Exception {
            if (!seen) {
                seen = true;
                mark("FIRST " + subtask);
            }
            JsonNode n = json.readTree(value);
            Order o = new Order();
            o.id = n.get("id").asLong();
            o.customer = text(n, "customer");
            JsonNode amount = n.get("amount");
            o.amount = amount == null || amount.isNull() ? null : amount.decimalValue();
            o.currency = text(n, "currency");
            o.ts = text(n, "ts");
            o.note = text(n, "note");
            return o;
        }

        private static String text(JsonNode n, String field) {
            JsonNode v = n.get(field);
            return v == null || v.isNull() ? null : v.asText();
        }

        private static void mark(String line) {
            synchronized (System.out) {
                System.out.println(line);
                System.out.flush();
            }
        }
    }
}
