"""Generated protobuf and gRPC code for the `cogmentAPI` package, and for the project's own
`cogment_aux.api` (`trial_status_pb2`), which imports it (see `shared.protos.generate`)."""
