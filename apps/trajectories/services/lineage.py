"""Reversible lineage (docs/trajectories.md, "Lineage"): raw events → normalized steps →
segments → packed samples, each layer append-only and versioned, every item naming its
sources in the layer below; a trace from any item down to the raw events; a deletion
request that walks the lineage, removes everything derived, and leaves a tombstone.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Max, Q, QuerySet

from apps.core import jsonsafe
from apps.core.errors import NotFound, ValidationFailed
from apps.tenancy.models import Tenant
from apps.trajectories import lineage_registry
from apps.trajectories.models import (
    Episode,
    LayerItem,
    LayerKind,
    LineageExport,
    LineageLayer,
    RawEvent,
    Step,
    Tombstone,
)
from apps.trajectories.services.secrets import EpisodeSecrets

SERVER_PARSER = "hedgerow.steps"
SERVER_PARSER_VERSION = "1"
STEP_SCHEMA = "hedgerow.episode/v1"
MAX_ITEMS = 10_000


def jsonable(value: Any) -> Any:
    """A JSON value (datetimes and decimals as strings)."""
    return json.loads(json.dumps(value, default=str))


def _sha256(value: Any) -> str:
    body = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()


def raw_event_record(
    *, episode: Episode, kind: str, body: Any, produced: list[int] | None = None
) -> RawEvent:
    """Appends what was received (already redacted by the caller). Hold the episode's
    row lock (or own a row nobody else sees yet): ``seq`` is the next number."""
    last = RawEvent.objects.filter(episode_id=episode.pk).aggregate(m=Max("seq"))["m"]
    body = jsonable(body)
    return RawEvent.objects.create(
        tenant_id=episode.tenant_id,
        episode_id=episode.pk,
        seq=0 if last is None else last + 1,
        kind=kind,
        body=body,
        sha256=_sha256(body),
        produced=sorted(set(produced or [])),
    )


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def step_record(step: Step) -> dict[str, Any]:
    """A step as the JSONL schema writes it (``hedgerow.episode/v1``)."""
    return {
        "index": step.index,
        "kind": step.kind,
        "action": step.action,
        "request": step.request,
        "observation": step.observation,
        "shown": step.shown,
        "diff": step.diff,
        "model_call": step.model_call,
        "sandbox_id": step.sandbox_ref,
        "generation": step.generation,
        "operation_id": step.operation_id,
        "started_at": _iso(step.started_at),
        "ended_at": _iso(step.ended_at),
        "duration_s": step.duration_s,
        "verifier": step.verifier,
    }


def _next_version(episode: Episode, kind: str) -> int:
    last = LineageLayer.objects.filter(episode=episode, kind=kind).aggregate(m=Max("version"))["m"]
    return 1 if last is None else last + 1


def normalize(
    *,
    episode: Episode,
    actor: str = "",
    parser: str = SERVER_PARSER,
    parser_version: str = SERVER_PARSER_VERSION,
) -> LineageLayer:
    """A new normalized layer from the server's parser: one item per stored step, its
    sources the raw events that produced it. Earlier layers stay."""
    if (parser, parser_version) != (SERVER_PARSER, SERVER_PARSER_VERSION):
        raise ValidationFailed(
            f"the server's parser is {SERVER_PARSER} {SERVER_PARSER_VERSION}; other parsers "
            "post their layer (POST …/layers)",
            field="parser",
        )
    with transaction.atomic():
        locked = Episode.objects.select_for_update().get(pk=episode.pk)
        producers: dict[int, list[int]] = {}
        for seq, produced in RawEvent.objects.filter(episode=locked).values_list("seq", "produced"):
            for index in produced or []:
                producers.setdefault(int(index), []).append(int(seq))
        layer = LineageLayer.objects.create(
            tenant_id=locked.tenant_id,
            episode=locked,
            kind=LayerKind.NORMALIZED,
            version=_next_version(locked, LayerKind.NORMALIZED),
            producer=parser,
            producer_version=parser_version,
            schema_version=STEP_SCHEMA,
            created_by=actor,
        )
        LayerItem.objects.bulk_create(
            LayerItem(
                layer=layer,
                position=position,
                sources=producers.get(step.index, []),
                data=jsonable(step_record(step)),
            )
            for position, step in enumerate(locked.steps.all())
        )
    return layer


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValidationFailed(f"{where} must be a non-empty list of integers", field=where)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValidationFailed(f"{where} must be a non-empty list of integers", field=where)
    return [int(v) for v in value]


def layer_create(
    *,
    episode: Episode,
    kind: str,
    producer: str,
    producer_version: str,
    items: list[Any],
    actor: str,
    source_layer: str | None = None,
    schema_version: str = "",
    params: dict[str, Any] | None = None,
) -> LineageLayer:
    """A client-built layer (a parser of its own, segments, packed samples). Checked
    whole before anything is stored:

    * ``normalized``: no source layer; each item ``{"raw_events": [seq…], "data"}``;
    * ``segments``: a normalized source; each item ``{"steps": [first, last], "reason",
      "evidence": {…}, "reward", "data"}`` with positions of the source layer;
    * ``packed``: a segments source and ``params.tokenizer`` + ``params.chat_template``;
      each item ``{"segments": [position…], "data"}``.

    Items are redacted like steps (their secrets become the episode's placeholders).
    """
    params = params or {}
    if kind not in LayerKind.values:
        raise ValidationFailed(f"kind is one of {', '.join(LayerKind.values)}", field="kind")
    if not producer or not producer_version:
        raise ValidationFailed("a layer names its producer and its version", field="producer")
    if not isinstance(items, list) or not items or len(items) > MAX_ITEMS:
        raise ValidationFailed(f"items: 1 to {MAX_ITEMS}", field="items")
    jsonsafe.require_no_nul(items, "items")
    jsonsafe.require_no_nul(params, "params")
    source: LineageLayer | None = None
    wanted_source = {
        LayerKind.NORMALIZED: None,
        LayerKind.SEGMENTS: LayerKind.NORMALIZED,
        LayerKind.PACKED: LayerKind.SEGMENTS,
    }[LayerKind(kind)]
    if wanted_source is None:
        if source_layer:
            raise ValidationFailed(
                "a normalized layer's sources are raw events", field="source_layer"
            )
    else:
        if not source_layer:
            raise ValidationFailed(f"a {kind} layer needs a source_layer", field="source_layer")
        source = _layer_of(episode, source_layer)
        if source.kind != wanted_source:
            raise ValidationFailed(
                f"a {kind} layer is derived from a {wanted_source} layer", field="source_layer"
            )
    if kind == LayerKind.PACKED:
        for name in ("tokenizer", "chat_template"):
            if not isinstance(params.get(name), str) or not params[name]:
                raise ValidationFailed(
                    f"a packed layer names its {name} (params.{name})", field=f"params.{name}"
                )
    with transaction.atomic():
        locked = Episode.objects.select_for_update().get(pk=episode.pk)
        if kind == LayerKind.NORMALIZED:
            valid = set(RawEvent.objects.filter(episode=locked).values_list("seq", flat=True))
        else:
            assert source is not None
            valid = set(source.items.values_list("position", flat=True))
        rows = [_item(kind, position, item, valid) for position, item in enumerate(items)]
        session = EpisodeSecrets(locked)
        for position, row in enumerate(rows):
            row.data = session.redact(row.data, f"items[{position}].data")
            row.evidence = session.redact(row.evidence, f"items[{position}].evidence")
            row.selection_reason = session.text(row.selection_reason, f"items[{position}].reason")
        layer = LineageLayer.objects.create(
            tenant_id=locked.tenant_id,
            episode=locked,
            kind=kind,
            version=_next_version(locked, kind),
            source=source,
            producer=producer,
            producer_version=producer_version,
            schema_version=schema_version,
            params=session.redact(params, "params"),
            created_by=actor,
        )
        for row in rows:
            row.layer = layer
        LayerItem.objects.bulk_create(rows)
        session.save()
    return layer


def _item(kind: str, position: int, item: Any, valid: set[int]) -> LayerItem:
    where = f"items[{position}]"
    if not isinstance(item, dict):
        raise ValidationFailed(f"{where} must be an object", field=where)
    row = LayerItem(position=position, data=item.get("data"))
    if kind == LayerKind.NORMALIZED:
        sources = _int_list(item.get("raw_events"), f"{where}.raw_events")
    elif kind == LayerKind.SEGMENTS:
        sources = _int_list(item.get("steps"), f"{where}.steps")
        if len(sources) != 2 or sources[0] > sources[1]:
            raise ValidationFailed(
                f"{where}.steps is [first, last] with first ≤ last", field=f"{where}.steps"
            )
        sources = list(range(sources[0], sources[1] + 1))
        reason = item.get("reason")
        if not isinstance(reason, str) or not reason.strip() or len(reason) > 200:
            raise ValidationFailed(
                f"{where}.reason (why it was selected) is required", field=f"{where}.reason"
            )
        row.selection_reason = reason.strip()
        evidence = item.get("evidence", {})
        if not isinstance(evidence, dict):
            raise ValidationFailed(f"{where}.evidence must be an object", field=f"{where}.evidence")
        row.evidence = evidence
        reward = item.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
            raise ValidationFailed(f"{where}.reward must be a number", field=f"{where}.reward")
        row.reward = None if reward is None else float(reward)
    else:
        sources = _int_list(item.get("segments"), f"{where}.segments")
    missing = sorted(set(sources) - valid)
    if missing:
        raise ValidationFailed(
            f"{where} names sources the layer below does not have: {missing[:10]}",
            field=where,
        )
    row.sources = sources if kind != LayerKind.SEGMENTS else [sources[0], sources[-1]]
    return row


def _layer_of(episode: Episode, layer_id: str) -> LineageLayer:
    pk = _uuid_or_none(layer_id)
    layer = None if pk is None else LineageLayer.objects.filter(episode=episode, pk=pk).first()
    if layer is None:
        raise NotFound(f"no layer {layer_id!r} in this episode", code="layer_not_found")
    return layer


def _uuid_or_none(value: str) -> str | None:
    import uuid

    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        return None


def layer_get(*, episode: Episode, layer_id: str) -> LineageLayer:
    return _layer_of(episode, layer_id)


def layer_summary(layer: LineageLayer) -> dict[str, Any]:
    return {
        "id": str(layer.pk),
        "kind": layer.kind,
        "version": layer.version,
        "source_layer": str(layer.source_id) if layer.source_id else None,
        "producer": layer.producer,
        "producer_version": layer.producer_version,
        "schema_version": layer.schema_version,
        "params": layer.params,
        "created_by": layer.created_by,
        "created_at": _iso(layer.created_at),
        "items": layer.items.count(),
    }


def item_record(item: LayerItem) -> dict[str, Any]:
    record: dict[str, Any] = {"position": item.position, "sources": item.sources, "data": item.data}
    if item.layer.kind == LayerKind.SEGMENTS:
        record.update(reason=item.selection_reason, evidence=item.evidence, reward=item.reward)
    return record


def raw_event_record_dict(event: RawEvent, *, body: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {
        "seq": event.seq,
        "kind": event.kind,
        "sha256": event.sha256,
        "produced": event.produced,
        "received_at": _iso(event.received_at),
    }
    if body:
        out["body"] = event.body
    return out


def episode_lineage(*, episode: Episode) -> dict[str, Any]:
    return {
        "episode_id": episode.episode_id,
        "raw_events": [
            raw_event_record_dict(e, body=False) for e in RawEvent.objects.filter(episode=episode)
        ],
        "layers": [
            layer_summary(layer)
            for layer in LineageLayer.objects.filter(episode=episode).order_by(
                "created_at", "version"
            )
        ],
    }


def trace(*, episode: Episode, layer_id: str, position: int) -> dict[str, Any]:
    """From one item down to the raw events it came from: each level's layer and the
    items of it that the level above names."""
    layer = _layer_of(episode, layer_id)
    item = layer.items.filter(position=position).first()
    if item is None:
        raise NotFound(f"no item {position} in layer {layer.pk}", code="item_not_found")
    levels: list[dict[str, Any]] = [{"layer": layer_summary(layer), "items": [item_record(item)]}]
    current, wanted = layer, _below(layer, [item])
    while current.source_id is not None:
        assert current.source is not None
        current = current.source
        items = list(current.items.filter(position__in=wanted))
        levels.append({"layer": layer_summary(current), "items": [item_record(i) for i in items]})
        wanted = _below(current, items)
    events = RawEvent.objects.filter(episode=episode, seq__in=wanted)
    return {
        "episode_id": episode.episode_id,
        "levels": levels,
        "raw_events": [raw_event_record_dict(e) for e in events],
    }


def _below(layer: LineageLayer, items: list[LayerItem]) -> set[int]:
    """Positions (or raw event seqs) in the layer below that these items came from."""
    out: set[int] = set()
    for item in items:
        sources = [int(s) for s in item.sources]
        if layer.kind == LayerKind.SEGMENTS and len(sources) == 2:
            out.update(range(sources[0], sources[1] + 1))
        else:
            out.update(sources)
    return out


def export_record(
    *, tenant: Tenant, episode_ids: list[str], actor: str, filters: dict[str, Any], kind: str
) -> LineageExport:
    """Records that an export holding these episodes was handed out (a deletion of any
    of them lists it in its tombstone)."""
    return LineageExport.objects.create(
        tenant=tenant, kind=kind, actor=actor, filters=filters, episode_ids=episode_ids
    )


def withdraw(*, tenant: Tenant, request: dict[str, Any], reason: str, actor: str) -> Tombstone:
    """A deletion request: ``{"task_id": …}`` (a withdrawn task), ``{"episode_ids":
    […]}`` or ``{"label": "k=v"}`` (a withdrawn source). Walks every layer derived from
    the episodes' raw events, every recorded export holding them and every registered
    dependent (datasets, analyses), then deletes the episodes with all their layers
    and leaves a tombstone. Nothing matched is a 404; nothing changes on an error."""
    if not reason.strip():
        raise ValidationFailed("a deletion needs a reason", field="reason")
    episodes = _withdrawn_episodes(tenant, request)
    with transaction.atomic():
        rows = list(episodes.select_for_update().order_by("started_at", "pk"))
        if not rows:
            raise NotFound("no episode matches this deletion request", code="nothing_to_delete")
        pks = [r.pk for r in rows]
        ids = [r.episode_id for r in rows]
        layers = _derived_layers(pks)
        items = LayerItem.objects.filter(layer__in=layers).count()
        raw = RawEvent.objects.filter(episode__in=pks)
        exports = LineageExport.objects.filter(tenant=tenant).filter(
            _any_contains("episode_ids", ids)
        )
        affects: list[dict[str, Any]] = [
            {
                "kind": "export",
                "id": e.pk,
                "export_kind": e.kind,
                "at": _iso(e.at),
                "actor": e.actor,
                "episodes": sorted(set(ids) & set(e.episode_ids)),
            }
            for e in exports
        ]
        withdrawal = lineage_registry.Withdrawal(
            tenant=tenant,
            episode_pks=tuple(str(pk) for pk in pks),
            episode_ids=tuple(ids),
            layer_ids=tuple(str(layer.pk) for layer in layers),
            request=request,
            reason=reason,
            actor=actor,
        )
        for name, finder in lineage_registry.dependents().items():
            for entry in finder(withdrawal):
                affects.append({"dependent": name, **entry})
        removed = {
            "episodes": [
                {
                    "episode_id": r.episode_id,
                    "task_id": r.task_id,
                    "provenance_key": r.provenance_key,
                    "steps": r.steps.count(),
                }
                for r in rows
            ],
            "raw_events": raw.count(),
            "layers": [
                {
                    "id": str(layer.pk),
                    "episode_id": layer.episode.episode_id,
                    "kind": layer.kind,
                    "version": layer.version,
                    "producer": layer.producer,
                    "producer_version": layer.producer_version,
                }
                for layer in layers
            ],
            "items": items,
        }
        tombstone = Tombstone.objects.create(
            tenant=tenant,
            request=request,
            reason=reason.strip(),
            actor=actor,
            removed=removed,
            affects=affects,
        )
        Episode.objects.filter(parent__in=pks).exclude(pk__in=pks).update(parent=None)
        LayerItem.objects.filter(layer__in=layers).delete()
        for layer in sorted(layers, key=_depth, reverse=True):
            layer.delete()
        Episode.objects.filter(pk__in=pks).delete()
    return tombstone


def _depth(layer: LineageLayer) -> int:
    return {LayerKind.NORMALIZED: 0, LayerKind.SEGMENTS: 1, LayerKind.PACKED: 2}.get(
        LayerKind(layer.kind), 0
    )


def _any_contains(field: str, values: list[str]) -> Q:
    q = Q()
    for value in values:
        q |= Q(**{f"{field}__contains": [value]})
    return q


def _derived_layers(episode_pks: list[Any]) -> list[LineageLayer]:
    """Every layer reachable from the episodes' normalized layers through ``source``
    links (and any layer of theirs), breadth first."""
    found: dict[Any, LineageLayer] = {
        layer.pk: layer
        for layer in LineageLayer.objects.filter(episode__in=episode_pks).select_related("episode")
    }
    frontier = list(found)
    while frontier:
        children = LineageLayer.objects.filter(source__in=frontier).select_related("episode")
        frontier = [c.pk for c in children if c.pk not in found]
        for child in children:
            found.setdefault(child.pk, child)
    return list(found.values())


def _withdrawn_episodes(tenant: Tenant, request: dict[str, Any]) -> QuerySet[Episode]:
    qs = Episode.objects.for_tenant(tenant)
    keys = [k for k in ("task_id", "episode_ids", "label") if request.get(k)]
    if len(keys) != 1:
        raise ValidationFailed(
            "a deletion names exactly one of task_id, episode_ids, label", field="task_id"
        )
    key = keys[0]
    value = request[key]
    if key == "task_id":
        if not isinstance(value, str):
            raise ValidationFailed("task_id must be a string", field="task_id")
        return qs.filter(task_id=value)
    if key == "episode_ids":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValidationFailed("episode_ids must be a list of ids", field="episode_ids")
        return qs.filter(episode_id__in=value)
    if not isinstance(value, str) or "=" not in value:
        raise ValidationFailed("label is key=value", field="label")
    label_key, _, wanted = value.partition("=")
    return qs.filter(**{f"labels__{label_key}": wanted})


def tombstones(*, tenant: Tenant) -> QuerySet[Tombstone]:
    return Tombstone.objects.filter(tenant=tenant)
