"""Keys of the records exchanged by the ServerApp and the ClientApp (kept import-light)."""

JOB = "fedmerge.job"  # ConfigRecord: round, cid, experiment config (JSON), algorithm module
PAYLOAD = "payload"  # server -> client: the client's own Payload
UPDATE = "update"  # client -> server: the Update
STATE = "state"  # client -> server: a copy of the ClientState (checkpoints); server -> client on resume
METRICS = "metrics"  # client -> server: evaluation metrics (MetricRecord)
STATE_KEY = "fedmerge.client_state"  # in context.state: ConfigRecord {"bytes": ClientState.to_bytes()}
