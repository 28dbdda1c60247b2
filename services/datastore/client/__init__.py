"""The Trial Datastore's client side: `api` (the Python client), `transfer` (exports and imports),
`trial_file` (the reference's export format), `dataset` (the Parquet export's rows), `training`
(training batches from them), the live replay buffer (`replay_buffer`, fed by `replay_feed` from
datastores `discovery` finds, its steps made by `replay_steps`, kept by `step_store`, picked by
`samplers` and `sum_tree`, paced by `rate_limiter`; `torch_batches` for PyTorch) and `cli` (the
command line over them). Nothing here is imported by the server."""
