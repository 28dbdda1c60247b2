"""`cogment-aux demo`: records trials of a small multi-actor environment into a Trial Datastore
as the Cogment 2.x orchestrator logs them, publishes versions of its policy to a Model Registry,
and registers its environment in a Directory (`services.demo.run` says how)."""
