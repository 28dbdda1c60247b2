"""Tables of the whole suite, in one SQLAlchemy metadata (one migration history).

Timestamps are integer nanoseconds since the Unix epoch, as on the wire.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    text,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

# ---- Directory ----

directory_services = Table(
    "directory_services",
    metadata,
    Column("service_id", BigInteger, primary_key=True, autoincrement=False),
    Column("registered_at", BigInteger, nullable=False),
    Column("protocol", SmallInteger, nullable=False),
    Column("host", Text, nullable=False),
    Column("port", Integer, nullable=False),
    Column("service_type", Integer, nullable=False),
    # Canonical JSON (sorted keys) of the full property map, and its SHA-256 for exact matching.
    Column("properties", Text, nullable=False),
    Column("properties_digest", String(64), nullable=False),
    Column("permanent", Boolean, nullable=False),
    # SHA-256 of the authentication token: tokens are never stored in clear.
    Column("token_digest", String(64), nullable=False),
    # The secret is derived from this nonce with the directory key: it is never stored either.
    Column("secret_nonce", String(64), nullable=False),
    Column("failed_checks", Integer, nullable=False, default=0),
    Column("load", SmallInteger, nullable=False, default=0),
    Column("last_check_at", BigInteger, nullable=False, default=0),
    # NULL for entries that are never checked (permanent, COGMENT protocol).
    Column("next_check_at", BigInteger, nullable=True),
    # A replica checking the entry holds it until then; an expired claim can be taken over.
    Column("claimed_until", BigInteger, nullable=False, default=0),
    Index(None, "token_digest", "service_type", "registered_at"),
    Index(None, "next_check_at"),
    # One permanent entry per (token, type, full property map): re-registrations update it.
    Index(
        "uq_directory_services_permanent_identity",
        "token_digest",
        "service_type",
        "properties_digest",
        unique=True,
        sqlite_where=text("permanent = 1"),
        postgresql_where=text("permanent"),
    ),
)
# The unique index a permanent registration upserts on.
directory_services_permanent_identity = next(
    index for index in directory_services.indexes if index.name == "uq_directory_services_permanent_identity"
)

# One row per property of an entry. Matching goes through `pair_digest`, the SHA-256 of the
# (name, value) pair: exact, and indexable whatever the size of names and values (PostgreSQL
# cannot index text rows over ~2.7 kB).
directory_service_properties = Table(
    "directory_service_properties",
    metadata,
    Column(
        "service_id",
        BigInteger,
        ForeignKey("directory_services.service_id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("pair_digest", String(64), primary_key=True),
    Column("name", Text, nullable=False),
    Column("value", Text, nullable=False),
    Index(None, "pair_digest", "service_id"),
)

directory_settings = Table(
    "directory_settings",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

# ---- Model Registry ----

# Models are keyed by `model_key`, the SHA-256 of the model id: ids are arbitrary strings of any
# length, and PostgreSQL cannot index text over ~2.7 kB. The id itself is kept unindexed.
registry_models = Table(
    "registry_models",
    metadata,
    Column("model_key", String(64), primary_key=True),
    Column("model_id", Text, nullable=False),
    # Canonical JSON (sorted keys) of the user data map.
    Column("user_data", Text, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    # The number the next version gets: taken under the model's row lock, which serializes the
    # commits of every replica (unique, gap-free numbers).
    Column("next_version", Integer, nullable=False, default=1),
)

registry_versions = Table(
    "registry_versions",
    metadata,
    Column(
        "model_key",
        String(64),
        ForeignKey("registry_models.model_key", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("version_number", Integer, primary_key=True, autoincrement=False),
    Column("creation_timestamp", BigInteger, nullable=False),
    Column("archived", Boolean, nullable=False),
    # SHA-256 of the data, base64 with padding (as on the wire).
    Column("data_hash", String(64), nullable=False),
    Column("data_size", BigInteger, nullable=False),
    Column("user_data", Text, nullable=False),
    # Where the data lives in the blob store: a key drawn per upload, so a version's commit made
    # again (its first answer was lost) finds the version it made by it (unique).
    Column("blob_key", String(255), nullable=False),
    # Least recently used transient versions are evicted first.
    Column("last_used_at", BigInteger, nullable=False),
    Index(None, "archived", "last_used_at"),
    Index(None, "blob_key", unique=True),
)

# Blobs to delete once `delete_after` has passed: uploads in progress (so a crash leaves nothing
# behind for good) and the data of deleted or evicted versions (after a grace period, so
# downloads in flight can finish).
registry_blob_garbage = Table(
    "registry_blob_garbage",
    metadata,
    Column("blob_key", String(255), primary_key=True),
    Column("delete_after", BigInteger, nullable=False),
    Index(None, "delete_after"),
)

# ---- Trial Datastore ----

# BIGINT on PostgreSQL; INTEGER on SQLite, where only an INTEGER primary key is the rowid.
TRIAL_SEQ = BigInteger().with_variant(Integer, "sqlite")


def _trial_reference() -> Column[int]:
    return Column(
        "trial_seq", TRIAL_SEQ, ForeignKey("datastore_trials.trial_seq", ondelete="CASCADE"), primary_key=True
    )


datastore_trials = Table(
    "datastore_trials",
    metadata,
    # Creation order: RetrieveTrials handles are positions in it. Never reused (AUTOINCREMENT on
    # SQLite), so a trial deleted and created again comes after pagers that passed its old place.
    Column("trial_seq", TRIAL_SEQ, primary_key=True, autoincrement=True),
    # SHA-256 of the trial id (see shared.digest); the id itself is kept unindexed.
    Column("trial_key", String(64), nullable=False, unique=True),
    Column("trial_id", Text, nullable=False),
    Column("user_id", Text, nullable=False),
    # Serialized cogmentAPI.TrialParams.
    Column("params", LargeBinary, nullable=False),
    Column("created_at", BigInteger, nullable=False),
    # Maintained by every write of samples: the number of rows in datastore_samples.
    Column("samples_count", BigInteger, nullable=False, default=0),
    # State of the last in-sync sample; out-of-sync samples leave it alone.
    Column("last_state", SmallInteger, nullable=False, default=0),
    # An ENDED sample was stored (never undone).
    Column("ended", Boolean, nullable=False, default=False),
    # The ingestion stream closed: live readers stop once they have every sample, ENDED or not.
    Column("closed", Boolean, nullable=False, default=False),
    # While an ingestion stream is open, its process renews this lease (ns); a trial whose lease
    # expired lost its stream with its process, and any replica closes it. 0: no open stream.
    Column("lease_until", BigInteger, nullable=False, default=0, server_default=text("0")),
    # The process that took or last renewed the lease (a random token of its own): where the
    # database has one host, a holder whose process is gone is known at once, before the lease
    # runs out (see services/datastore/lease_holders.py).
    Column("lease_holder", String(32), nullable=False, default="", server_default=text("''")),
    Index(None, "lease_until"),
    sqlite_autoincrement=True,
)

# One row per trial property, matched through its (name, value) digest.
datastore_trial_properties = Table(
    "datastore_trial_properties",
    metadata,
    _trial_reference(),
    Column("pair_digest", String(64), primary_key=True),
    Index(None, "pair_digest", "trial_seq"),
)

# How many samples each ingestion stream stored in its trial, written with them: an append retried
# after its answer was lost finds its samples counted here and stores only what is missing.
datastore_ingestion_streams = Table(
    "datastore_ingestion_streams",
    metadata,
    _trial_reference(),
    # Random, chosen by the stream's process when the stream opens.
    Column("stream_id", BigInteger, primary_key=True, autoincrement=False),
    Column("appended", BigInteger, nullable=False),
)

datastore_samples = Table(
    "datastore_samples",
    metadata,
    _trial_reference(),
    # Arrival order within the trial, from 0: samples are replayed in it.
    Column("sample_seq", BigInteger, primary_key=True, autoincrement=False),
    # Serialized cogmentAPI.StoredTrialSample, replayed as is when no filter applies.
    Column("data", LargeBinary, nullable=False),
)
