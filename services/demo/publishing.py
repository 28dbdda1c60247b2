"""The demo's policy in a Model Registry, and its environment in a Directory.

* Registry: the model (`--model_id`, user data naming the demo) is created or its user data
  updated, then each stage's weights (`world.policy_weights`, a serialized
  `spec_pb2.PolicyWeights`) are published as an archived version, unless the model already has a
  version with the same SHA-256: the weights never change, so running the demo again publishes
  nothing new and its trials name the same versions.
* Directory: the environment is registered as a permanent ENVIRONMENT_SERVICE (never
  health-checked: the demo serves nothing, its trials are played in its own process) with the
  properties of `ENVIRONMENT_PROPERTIES`, which the orchestrator's discovery of its
  implementation (`cogment://discover/environment?__implementation=...`) matches. Registering
  again with the same type, properties and token updates that entry in place (same id), so
  running the demo again adds no entry.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from services.demo.orchestration import ENVIRONMENT_IMPLEMENTATION, PlayerPolicy
from services.demo.world import GRID_SIZE, OBSERVATION_SIZE, STAGES, policy_weights
from services.directory.client.api import DirectoryClient
from services.model_registry.client.api import ModelRegistryClient
from shared.api import directory_pb2
from shared.client import ClientError
from shared.endpoints import GrpcEndpoint

DEFAULT_MODEL_ID = "cogment-aux-demo-policy"
WEIGHTS_MESSAGE = "cogment_aux_demo.PolicyWeights"
MODEL_USER_DATA = {
    "demo": "cogment-aux",
    "environment": ENVIRONMENT_IMPLEMENTATION,
    "weights": WEIGHTS_MESSAGE,
    "stages": ",".join(stage.name for stage in STAGES),
}
# What the environment is registered and found with (no `__version`: a new release of the demo
# updates the same entry).
ENVIRONMENT_PROPERTIES = {
    "__implementation": ENVIRONMENT_IMPLEMENTATION,
    "__registration_source": "cogment-aux-demo",
    "demo": "cogment-aux",
}
DISCOVERY_URL = f"cogment://discover/environment?__implementation={ENVIRONMENT_IMPLEMENTATION}"


@dataclass(frozen=True)
class PolicyVersion:
    """A stage's weights in the registry: its version, and whether this run published it (False:
    the model had it already)."""

    stage: str
    version_number: int
    data_hash: str
    data_size: int
    published: bool


def data_hash(data: bytes) -> str:
    """SHA-256 in base64, as the registry's `data_hash`."""
    return base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")


def local_policies(model_id: str, versions: Mapping[str, int] | None = None) -> dict[str, PlayerPolicy]:
    """Each stage's policy by its name, with its model version (`versions`; 0 when absent)."""
    return {
        stage.name: PlayerPolicy(stage, policy_weights(stage), model_id, (versions or {}).get(stage.name, 0))
        for stage in STAGES
    }


async def publish_policies(registry: ModelRegistryClient, model_id: str) -> list[PolicyVersion]:
    """Create (or update) the model, and give each stage's weights a version: an existing one
    with the same data, or a new one."""
    await registry.create_model(model_id, MODEL_USER_DATA)
    existing = {info.data_hash: info for info in await registry.list_versions(model_id)}
    versions = []
    for stage in STAGES:
        data = policy_weights(stage).SerializeToString(deterministic=True)
        found = existing.get(data_hash(data))
        if found is not None:
            versions.append(
                PolicyVersion(stage.name, found.version_number, found.data_hash, found.data_size, False)
            )
            continue
        user_data = {
            "stage": stage.name,
            "description": stage.description,
            "greedy_share": f"{stage.greedy_share:g}",
            "epsilon": f"{stage.epsilon:g}",
            "weights": WEIGHTS_MESSAGE,
            "observation_size": str(OBSERVATION_SIZE),
            "grid_size": str(GRID_SIZE),
        }
        info = await registry.publish_version(model_id, data, archived=True, user_data=user_data)
        if info.data_hash != data_hash(data):
            raise ClientError(
                f"the model registry at {registry.endpoint} stored version {info.version_number} of "
                f"[{model_id}] with the SHA-256 {info.data_hash}, not that of the data sent"
            )
        versions.append(PolicyVersion(stage.name, info.version_number, info.data_hash, info.data_size, True))
    return versions


def environment_registration(endpoint: GrpcEndpoint) -> directory_pb2.RegisterRequest:
    protocol = directory_pb2.ServiceEndpoint.GRPC_SSL if endpoint.tls else directory_pb2.ServiceEndpoint.GRPC
    return directory_pb2.RegisterRequest(
        endpoint=directory_pb2.ServiceEndpoint(protocol=protocol, host=endpoint.host, port=endpoint.port),
        details=directory_pb2.ServiceDetails(
            type=directory_pb2.ENVIRONMENT_SERVICE, properties=ENVIRONMENT_PROPERTIES
        ),
        permanent=True,
    )


async def register_environment(directory: DirectoryClient, endpoint: GrpcEndpoint) -> int:
    """Register (or update) the environment's permanent entry at `endpoint`; its service id."""
    reply = await directory.register(environment_registration(endpoint))
    if reply.status != directory_pb2.RegisterReply.OK:
        raise ClientError(
            f"the directory at {directory.endpoint} refused the environment's registration: {reply.error_msg}"
        )
    return int(reply.service_id)
