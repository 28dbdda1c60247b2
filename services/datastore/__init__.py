"""Trial Datastore: datalog ingestion, stored trials, replay and live streams of samples."""
