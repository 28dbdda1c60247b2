"""Print the message and service layouts of the `cogmentAPI` protos as JSON.

Run with the official SDK's interpreter (`<sdk venv>/bin/python dump_descriptors.py cogment.api`)
or ours (`shared.api`), so a test can compare the two field by field.
"""

import importlib
import json
import sys

FILES = ["common", "directory", "model_registry", "trial_datastore", "datalog", "environment"]


def is_repeated(field):
    # `label` is gone from protobuf 7; the SDK's protobuf 3 has no `is_repeated`.
    if hasattr(field, "is_repeated"):
        return field.is_repeated
    return field.label == field.LABEL_REPEATED


def describe_message(message, layouts):
    layouts[message.full_name] = {
        field.name: [
            field.number,
            field.type,
            is_repeated(field),
            field.containing_oneof.name if field.containing_oneof else "",
            field.message_type.full_name if field.message_type else "",
            field.enum_type.full_name if field.enum_type else "",
        ]
        for field in message.fields
    }
    for nested in message.nested_types:
        describe_message(nested, layouts)


def main(package):
    messages, services = {}, {}
    for name in FILES:
        descriptor = importlib.import_module(f"{package}.{name}_pb2").DESCRIPTOR
        for message in descriptor.message_types_by_name.values():
            describe_message(message, messages)
        for service in descriptor.services_by_name.values():
            services[service.full_name] = {
                method.name: [
                    method.input_type.full_name,
                    method.output_type.full_name,
                    # Streaming flags only exist on newer protobuf runtimes; fall back to the proto.
                    getattr(method, "client_streaming", None),
                    getattr(method, "server_streaming", None),
                ]
                for method in service.methods
            }
    json.dump({"messages": messages, "services": services}, sys.stdout, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1])
