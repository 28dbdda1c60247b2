"""The Model Registry: models, their versions and the version data, kept in a blob store."""
