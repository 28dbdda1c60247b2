"""The Trial Datastore's client side: `api` (the Python client), `transfer` (exports and imports),
`trial_file` (the reference's export format), `dataset` (the Parquet export's rows), `training`
(training batches from them) and `cli` (the command line over them). Nothing here is imported by
the server."""
