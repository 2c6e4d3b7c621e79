"""Plan sessions and steps: where keys are made, by the runtime and never the model."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from ._canonical import JSONObject, Profile, check_profile, encode_jsonable, to_jsonable
from ._exceptions import AgentKeyError, ConfigurationError, InvalidArguments
from ._keys import (
    StepKey,
    format_step,
    normalize_step,
    plan_id_from_external,
    validate_plan_session_id,
)

__all__ = ["PlanSession", "Step"]

ArgsModels = Mapping[str, type[BaseModel]]


class Step(BaseModel):
    """One tool call of a plan, with its deterministic key.

    ``args`` holds the arguments already converted to plain JSON values (and
    normalised by the step's ``args_model`` when one was given); those are
    exactly what is hashed and sent.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan_session_id: str
    index: tuple[int, ...]
    tool: str = Field(min_length=1)
    args: JSONObject
    profile: Profile = "python"

    def __init__(
        self,
        *,
        plan_session_id: str,
        index: int | Sequence[int],
        tool: str,
        args: Mapping[str, Any] | BaseModel,
        profile: Profile = "python",
    ) -> None:
        # Validate here, not in pydantic validators, so bad input raises agentkey's
        # typed errors (InvalidKey, InvalidArguments) rather than a ValidationError.
        if not isinstance(tool, str) or not tool:
            raise ConfigurationError(f"tool name must be a non-empty str, got {tool!r}")
        super().__init__(
            plan_session_id=validate_plan_session_id(plan_session_id),
            index=normalize_step(index),
            tool=tool,
            args=to_jsonable(args),
            profile=check_profile(profile),
        )

    @cached_property
    def body(self) -> bytes:
        """The request body: the canonical JSON bytes the key's hash covers."""
        return encode_jsonable(self.args, self.profile)

    @cached_property
    def key(self) -> StepKey:
        """The parsed key of this step."""
        return StepKey(self.plan_session_id, self.index, hashlib.sha256(self.body).hexdigest())

    @cached_property
    def idempotency_key(self) -> str:
        """The raw ``Idempotency-Key`` value, computed once."""
        return self.key.format()

    @property
    def label(self) -> str:
        """The step label, e.g. ``step_003.001``."""
        return format_step(self.index)


class PlanSession(BaseModel):
    """One root planning session, from the first step to the last.

    Create it once with :meth:`new` (or :meth:`from_external_id` to reuse a
    framework's own id such as a LangGraph ``thread_id``) and persist it with
    the plan (:meth:`to_json` / :meth:`from_json`), so retries, replans and
    orchestrator restarts keep producing the same keys.

    ``args_models`` maps a tool name to a pydantic model that normalises that
    tool's arguments before hashing. Models are code, not data: they are not
    serialised; pass them again to :meth:`from_json`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    profile: Profile = "python"
    _args_models: dict[str, type[BaseModel]] = PrivateAttr(default_factory=dict)

    @field_validator("id")
    @classmethod
    def _valid_id(cls, value: str) -> str:
        return validate_plan_session_id(value)

    def __init__(
        self, *, id: str, profile: Profile = "python", args_models: ArgsModels | None = None
    ) -> None:
        super().__init__(id=validate_plan_session_id(id), profile=check_profile(profile))
        self._args_models.update(_check_args_models(args_models))

    @classmethod
    def new(
        cls, *, profile: Profile = "python", args_models: ArgsModels | None = None
    ) -> PlanSession:
        """Start a new plan session with a random UUID4 id."""
        return cls(id=str(uuid.uuid4()), profile=profile, args_models=args_models)

    @classmethod
    def from_external_id(
        cls, external_id: str, *, profile: Profile = "python", args_models: ArgsModels | None = None
    ) -> PlanSession:
        """Use a framework's id as the plan id: as is when valid, else as a UUIDv5 of it."""
        return cls(id=plan_id_from_external(external_id), profile=profile, args_models=args_models)

    def to_json(self) -> str:
        """Serialise the session for persistence."""
        return self.model_dump_json()

    @classmethod
    def from_json(cls, data: str | bytes, *, args_models: ArgsModels | None = None) -> PlanSession:
        """Restore a session saved with :meth:`to_json`."""
        try:
            doc = json.loads(data)
        except (ValueError, TypeError):
            doc = None
        if not isinstance(doc, dict) or "id" not in doc or set(doc) - {"id", "profile"}:
            raise ConfigurationError(
                "saved plan session is not valid: expected the JSON object "
                'PlanSession.to_json() writes, {"id": ..., "profile": ...}'
            )
        try:
            return cls(id=doc["id"], profile=doc.get("profile", "python"), args_models=args_models)
        except AgentKeyError as exc:
            raise ConfigurationError(f"saved plan session is not valid: {exc}") from None

    def step(
        self,
        index: int | Sequence[int],
        tool: str,
        args: Mapping[str, Any] | BaseModel,
        *,
        args_model: type[BaseModel] | None = None,
    ) -> Step:
        """Build the step ``index`` calling ``tool`` with ``args``.

        ``args_model`` (or the model registered for ``tool``) validates and
        normalises the arguments first, so ``{"storage_gb": "20"}`` and
        ``{"storage_gb": 20}`` give one key when the schema says int.
        """
        steps = normalize_step(index)
        if not isinstance(tool, str) or not tool:
            raise ConfigurationError(f"tool name must be a non-empty str, got {tool!r}")
        model = args_model if args_model is not None else self._args_models.get(tool)
        if model is not None:
            args = _validate_with(model, args, tool, format_step(steps))
        return Step(
            plan_session_id=self.id, index=steps, tool=tool, args=args, profile=self.profile
        )


def _check_args_models(args_models: ArgsModels | None) -> dict[str, type[BaseModel]]:
    out: dict[str, type[BaseModel]] = {}
    for tool, model in (args_models or {}).items():
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise ConfigurationError(
                f"args_models[{tool!r}] must be a pydantic BaseModel subclass, got {model!r}"
            )
        out[tool] = model
    return out


def _validate_with(model: type[BaseModel], args: object, tool: str, label: str) -> BaseModel:
    try:
        if isinstance(args, BaseModel):
            args = args.model_dump(mode="json")
        return model.model_validate(args)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidArguments(
            f"arguments of tool {tool!r} at {label} do not match {model.__name__}: "
            f"{first['msg']} ({exc.error_count()} error(s)); fix the arguments before calling",
            path=f"args.{where}" if where else "args",
        ) from None  # pydantic's error quotes the input values, which may be secrets
