"""Generated protobuf and gRPC code for the `cogmentAPI` package (see `shared.protos.generate`)."""
