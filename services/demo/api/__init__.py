"""The Python modules generated from the demo's protos (`services/demo/protos/cogment_aux_demo/`,
by `python -m shared.protos.generate`): `spec_pb2` holds the messages of its trials."""
