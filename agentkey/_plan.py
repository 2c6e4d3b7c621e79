"""Plan sessions and steps: where keys are made, by the runtime and never the model."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from ._canonical import JSONObject, Profile, check_profile, encode_jsonable, plain_and_body
from ._exceptions import AgentKeyError, ConfigurationError, InvalidArguments, StepRepeated
from ._keys import (
    StepKey,
    format_step,
    key_prefix,
    normalize_step,
    plan_id_from_external,
    validate_plan_session_id,
)

__all__ = ["OnRepeat", "PlanSession", "Step"]

ArgsModels = Mapping[str, type[BaseModel]]

#: What a plan does when a call (same tool, same arguments) comes again at another step:
#: ``"replay"`` answers with the earlier step (its key, so the server replays its stored
#: answer), ``"raise"`` raises :class:`~agentkey.StepRepeated`, ``"allow"`` runs a new step.
OnRepeat = Literal["allow", "replay", "raise"]
_ON_REPEAT: tuple[str, ...] = get_args(OnRepeat)
_HASH = re.compile(r"[0-9a-f]{64}")


def check_on_repeat(value: object) -> OnRepeat:
    """``value`` when it is one of the :data:`OnRepeat` policies, else ConfigurationError."""
    if value not in _ON_REPEAT:
        raise ConfigurationError(f"on_repeat must be one of {list(_ON_REPEAT)}, got {value!r}")
    return value  # type: ignore[return-value]


_set = object.__setattr__
_new = object.__new__
_sha256 = hashlib.sha256


class Step(BaseModel):
    """One tool call of a plan, with its deterministic key.

    ``args`` holds the arguments as plain JSON values (normalised by the step's
    ``args_model`` when one was given): exactly what is hashed and sent. Arguments
    that already were plain JSON are kept as given, not copied; :attr:`body` and
    :attr:`key` are fixed when the step is made, so editing them afterwards changes
    neither the key nor what is sent.

    Words: a ``Step`` is the call; :attr:`index` is its position as a tuple of
    ints (``(3, 1)``); :attr:`label` is that position as text (``step_003.001``),
    which is what results, errors and events call ``step``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)  # on first use

    plan_session_id: str
    index: tuple[int, ...]
    tool: str = Field(min_length=1)
    args: JSONObject
    profile: Profile = "python"
    #: Set when the plan answered a repeated call with this earlier step (``on_repeat="replay"``):
    #: the label of the step whose key (and so whose stored answer) this is.
    repeat_of: str | None = None
    #: What the invoker does when its journal shows this call (same tool and arguments)
    #: already sent at another step of the plan: the ``on_repeat`` it was made with.
    on_repeat: OnRepeat = Field(default="replay", exclude=True, repr=False)

    def __init__(
        self,
        *,
        plan_session_id: str,
        index: int | Sequence[int],
        tool: str,
        args: Mapping[str, Any] | BaseModel,
        profile: Profile = "python",
        repeat_of: str | None = None,
        on_repeat: OnRepeat = "replay",
    ) -> None:
        # Validate here, not in pydantic validators, so bad input raises agentkey's
        # typed errors (InvalidKey, InvalidArguments) rather than a ValidationError.
        _check_tool(tool)
        plan_session_id = validate_plan_session_id(plan_session_id)
        steps = normalize_step(index)
        plain, body = plain_and_body(args, check_profile(profile))
        super().__init__(
            plan_session_id=plan_session_id,
            index=steps,
            tool=tool,
            args=plain,
            profile=profile,
            repeat_of=repeat_of,
            on_repeat=check_on_repeat(on_repeat),
        )
        self.__dict__["body"] = body  # fixed now: the cached_property below reads it

    @classmethod
    def _made(
        cls,
        plan_session_id: str,
        index: tuple[int, ...],
        raw: str,
        tool: str,
        args: JSONObject,
        profile: Profile,
        body: bytes,
        repeat_of: str | None = None,
        on_repeat: OnRepeat = "replay",
    ) -> Step:
        """A step from parts :meth:`PlanSession.step` already validated and computed.

        What ``model_construct`` does, without its per-field loop: the plan's hot path.
        ``raw`` is the raw key; the :class:`StepKey` object is made on first use.
        """
        step = _new(cls)
        _set(
            step,
            "__dict__",
            {
                "plan_session_id": plan_session_id,
                "index": index,
                "tool": tool,
                "args": args,
                "profile": profile,
                "repeat_of": repeat_of,
                "on_repeat": on_repeat,
                "body": body,  # the cached properties below, already known
                "idempotency_key": raw,
            },
        )
        _set(step, "__pydantic_fields_set__", _FIELDS_SET)
        _set(step, "__pydantic_extra__", None)
        _set(step, "__pydantic_private__", None)
        return step

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Step:
        """A copy; with ``update``, a new step validated like the constructor.

        pydantic's own copy carries the cached body and key over, so an updated copy
        would send the old arguments' bytes under the old key: refused by rebuilding.
        """
        if not update:
            return super().model_copy(deep=deep)
        fields = {name: getattr(self, name) for name in _FIELDS_SET}
        return Step(**{**fields, **update})

    @cached_property
    def body(self) -> bytes:
        """The request body: the canonical JSON bytes the key's hash covers."""
        return encode_jsonable(self.args, self.profile)

    @cached_property
    def key(self) -> StepKey:
        """The parsed key of this step."""
        raw = self.__dict__.get("idempotency_key")
        if raw is not None:  # made by the plan: its parts are validated, its digest known
            return StepKey._trusted(self.plan_session_id, self.index, raw[-64:])
        return StepKey(self.plan_session_id, self.index, hashlib.sha256(self.body).hexdigest())

    @cached_property
    def idempotency_key(self) -> str:
        """The raw ``Idempotency-Key`` value, computed once."""
        return self.key.format()

    @property
    def label(self) -> str:
        """The step label, e.g. ``step_003.001``."""
        return format_step(self.index)


# The fields a validated Step reports as set (Step.__init__ passes them all). Shared:
# pydantic never changes an instance's set in place (model_copy copies it first).
_FIELDS_SET = {"plan_session_id", "index", "tool", "args", "profile", "repeat_of", "on_repeat"}


def _check_tool(tool: object) -> None:
    if not isinstance(tool, str) or not tool:
        raise ConfigurationError(f"tool name must be a non-empty str, got {tool!r}")


class _Memory:
    """What a :class:`PlanSession` remembers: its args models and every step handed out.

    One private attribute rather than four, so a step reads the session's private
    state once. Single dict operations keep it safe for concurrent calls.
    """

    __slots__ = ("args_models", "first", "handed", "prefixes", "tools")

    def __init__(self) -> None:
        self.args_models: dict[str, type[BaseModel]] = {}
        # Every step handed out, in order: (index, tool, args_hash). The two maps
        # below are derived from it.
        self.handed: dict[tuple[tuple[int, ...], str, str], None] = {}
        self.tools: dict[tuple[int, ...], str] = {}
        self.first: dict[tuple[str, str], tuple[int, ...]] = {}
        # The raw key before its hash, per index given out (formatted once per index).
        self.prefixes: dict[tuple[int, ...], str] = {}

    def __eq__(self, other: object) -> bool:  # sessions compare equal by what they remember
        if not isinstance(other, _Memory):
            return NotImplemented
        return (self.args_models, self.handed) == (other.args_models, other.handed)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def remember(
        self, plan_id: str, index: tuple[int, ...], tool: str, args_hash: str
    ) -> tuple[int, ...]:
        """Record a step handed out; return the first index this call was handed out at."""
        bound = self.tools.setdefault(index, tool)
        if bound != tool:
            label = format_step(index)
            raise ConfigurationError(
                f"plan {plan_id!r} already gave {label} to tool {bound!r}; giving it to tool "
                f"{tool!r} too would make the server answer one with the other's stored "
                f"result. Give each tool call its own step index (e.g. the next free one), "
                "or start a new PlanSession for a new plan"
            )
        self.handed.setdefault((index, tool, args_hash), None)
        return self.first.setdefault((tool, args_hash), index)

    def key(self, plan_id: str, index: tuple[int, ...], args_hash: str) -> str:
        """The raw key of a step of this plan (``index`` normalised, ``args_hash`` a digest).

        The prefix is formatted once per index (:meth:`PlanSession.step` reads the kept
        prefix inline and calls this only the first time).
        """
        prefix = self.prefixes.get(index)
        if prefix is None:
            prefix = self.prefixes.setdefault(index, key_prefix(plan_id, index))
        return prefix + args_hash


class PlanSession(BaseModel):
    """One root planning session, from the first step to the last.

    Create it once with :meth:`new` (or :meth:`from_external_id` to reuse a
    framework's own id such as a LangGraph ``thread_id``) and persist it with
    the plan (:meth:`to_json` / :meth:`from_json`), so retries, replans and
    orchestrator restarts keep producing the same keys.

    The session remembers every step it handed out (index, tool, args hash)
    and keeps that memory through :meth:`to_json`, so it can refuse two things
    a server could only get wrong: one step index for two different tools
    (:class:`~agentkey.ConfigurationError`), and, by default, a call that
    comes again at another step with the same tool and arguments (see
    ``on_repeat`` in :meth:`step`).

    ``args_models`` maps a tool name to a pydantic model that normalises that
    tool's arguments before hashing. Models are code, not data: they are not
    serialised; pass them again to :meth:`from_json`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)  # on first use

    id: str
    profile: Profile = "python"
    _memory: _Memory = PrivateAttr(default_factory=_Memory)

    @property
    def _memory_(self) -> _Memory:
        # pydantic's own lookup of a private attribute (self._memory) costs microseconds
        return self.__pydantic_private__["_memory"]  # type: ignore[index,no-any-return]

    @field_validator("id")
    @classmethod
    def _valid_id(cls, value: str) -> str:
        return validate_plan_session_id(value)

    def __init__(
        self, *, id: str, profile: Profile = "python", args_models: ArgsModels | None = None
    ) -> None:
        super().__init__(id=validate_plan_session_id(id), profile=check_profile(profile))
        self._memory_.args_models.update(_check_args_models(args_models))

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

    def to_dict(self) -> dict[str, Any]:
        """The session as a plain JSON object: id, profile and the steps handed out so far."""
        return {
            "id": self.id,
            "profile": self.profile,
            "steps": [[list(index), tool, h] for index, tool, h in list(self._memory_.handed)],
        }

    def to_json(self) -> str:
        """Serialise the session for persistence, as a JSON string (see :meth:`to_dict`)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(
        cls, data: str | bytes | Mapping[str, Any], *, args_models: ArgsModels | None = None
    ) -> PlanSession:
        """Restore a session saved with :meth:`to_json` (or :meth:`to_dict`).

        Accepts the JSON text, or the object already parsed. Sessions saved
        before steps were remembered (only ``id`` and ``profile``) still load.
        """
        doc: object = data
        if isinstance(data, (str, bytes, bytearray)):
            try:
                doc = json.loads(data)
            except (ValueError, TypeError):
                doc = None
        if not isinstance(doc, Mapping) or "id" not in doc or set(doc) - {"id", "profile", "steps"}:
            raise ConfigurationError(
                "saved plan session is not valid: expected the JSON object "
                'PlanSession.to_json() writes, {"id": ..., "profile": ..., "steps": [...]}'
            )
        try:
            session = cls(
                id=doc["id"], profile=doc.get("profile", "python"), args_models=args_models
            )
            for entry in _saved_steps(doc.get("steps", [])):
                session._remember(*entry)
        except AgentKeyError as exc:
            raise ConfigurationError(f"saved plan session is not valid: {exc}") from None
        return session

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, args_models: ArgsModels | None = None
    ) -> PlanSession:
        """Restore a session from the object :meth:`to_dict` gave."""
        return cls.from_json(data, args_models=args_models)

    def step(
        self,
        index: int | Sequence[int],
        tool: str,
        args: Mapping[str, Any] | BaseModel,
        *,
        args_model: type[BaseModel] | None = None,
        on_repeat: OnRepeat = "replay",
    ) -> Step:
        """Build the step ``index`` calling ``tool`` with ``args``.

        ``args_model`` (or the model registered for ``tool``) validates and
        normalises the arguments first, so ``{"storage_gb": "20"}`` and
        ``{"storage_gb": 20}`` give one key when the schema says int.

        One index names one operation: asking for an index that this session
        already gave to another tool raises :class:`~agentkey.ConfigurationError`
        (the server would answer one tool with the other's stored result).
        Asking again for the same index (a retry, a restart) gives the same key.

        ``on_repeat`` decides what happens when the same tool and arguments
        come again at another index (a model repeating a call that was already
        made): ``"replay"`` (the default) returns the earlier step, with
        :attr:`Step.repeat_of` set, so the server replays its stored answer and
        nothing runs twice; ``"raise"`` raises :class:`~agentkey.StepRepeated`;
        ``"allow"`` builds the new step, which runs again.
        """
        steps = normalize_step(index)
        if on_repeat not in _ON_REPEAT or not isinstance(tool, str) or not tool:
            check_on_repeat(on_repeat)
            _check_tool(tool)
        memory: _Memory = self.__pydantic_private__["_memory"]  # type: ignore[index]
        model = args_model if args_model is not None else memory.args_models.get(tool)
        if model is not None:
            args = _validate_with(model, args, tool, format_step(steps))
        plan_id, profile = self.id, self.profile
        plain, body = plain_and_body(args, profile)
        digest = _sha256(body).hexdigest()
        earlier = memory.remember(plan_id, steps, tool, digest)
        if earlier == steps or on_repeat == "allow":
            prefix = memory.prefixes.get(steps)
            raw = prefix + digest if prefix is not None else memory.key(plan_id, steps, digest)
            return Step._made(plan_id, steps, raw, tool, plain, profile, body, None, on_repeat)
        label = format_step(earlier)
        if on_repeat == "raise":
            raw = memory.key(plan_id, steps, digest)
            step = Step._made(plan_id, steps, raw, tool, plain, profile, body)
            raise repeated_error(step, label)
        raw = memory.key(plan_id, earlier, digest)
        return Step._made(plan_id, earlier, raw, tool, plain, profile, body, label, on_repeat)

    def _remember(self, index: tuple[int, ...], tool: str, args_hash: str) -> tuple[int, ...]:
        """Record a step handed out; return the first index this call was handed out at."""
        return self._memory_.remember(self.id, index, tool, args_hash)


def repeated_error(step: Step, previous: str) -> StepRepeated:
    """The :class:`~agentkey.StepRepeated` for ``step``, a repeat of step ``previous``."""
    key = StepKey(step.plan_session_id, normalize_step(_parse_label(previous)), step.key.args_hash)
    return StepRepeated(
        f"tool {step.tool!r} was already called with these arguments at {previous} of plan "
        f"{step.plan_session_id!r}; {step.label} would run it a second time. If the model "
        "asked again by mistake, tell it the call is done; if it really is a new operation, "
        "change an argument or use on_repeat='allow' for this tool",
        tool=step.tool,
        previous_step=previous,
        idempotency_key=key.format(),
    )


def _parse_label(label: str) -> tuple[int, ...]:
    return tuple(int(p) for p in label.removeprefix("step_").split("."))


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


def _saved_steps(saved: object) -> list[tuple[tuple[int, ...], str, str]]:
    """The ``steps`` of a saved session, checked: ``[[index...], tool, args_hash]`` each."""
    if not isinstance(saved, list):
        raise ConfigurationError("'steps' must be a list")
    out: list[tuple[tuple[int, ...], str, str]] = []
    for entry in saved:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[1], str)
            and entry[1]
            and isinstance(entry[2], str)
            and _HASH.fullmatch(entry[2])
        ):
            raise ConfigurationError(f"step entry {entry!r} is not [[index...], tool, args_hash]")
        out.append((normalize_step(entry[0]), entry[1], entry[2]))
    return out
