"""Dataset pages: the list (with the create form and the quarantine list), a dataset's
data card, and the harness × policy matrix. Reads through selectors and services."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_POST

from apps.core import keyset
from apps.core.errors import ApiError, ValidationFailed
from apps.datasets import selectors
from apps.datasets.models import Dataset
from apps.datasets.services.cards import dataset_card
from apps.datasets.services.matrix import POLICY_FIELDS, episode_matrix
from apps.datasets.services.splits import (
    GROUP_KEYS,
    TEMPORAL_FIELDS,
    DatasetSpec,
    dataset_create,
    dataset_get,
)
from apps.tenancy.pages import page, render_page
from apps.tenancy.principal import Principal

DATASETS_PAGE = 50  # datasets per page of the list
FILTER_FIELDS = ("task", "model", "harness", "policy_version", "label", "since", "until")


@require_GET
@page()
def dataset_list_page(request: HttpRequest, principal: Principal) -> HttpResponse:
    cursor = request.GET.get("cursor", "")
    # cursor pages, newest first (a cursor that does not decode starts over, as the
    # sandbox and image lists do): every dataset is reachable, none read twice
    listed = keyset.newest_first(
        Dataset.objects.filter(tenant=principal.tenant), cursor=cursor, limit=DATASETS_PAGE
    )
    return render_page(
        request,
        principal,
        "datasets/list.html",
        {
            "nav_section": "datasets",
            "datasets": listed.rows,
            "cursor": cursor,
            "next_cursor": listed.next_cursor,
            "quarantine": selectors.quarantine_list(tenant=principal.tenant),
            "group_keys": GROUP_KEYS,
            "temporal_fields": TEMPORAL_FIELDS,
            "filter_fields": FILTER_FIELDS,
        },
    )


def _fraction(raw: str, name: str) -> float:
    try:
        return float(raw or 0)
    except ValueError:
        raise ValidationFailed("a fraction is a number", field=f"fractions.{name}") from None


@require_POST
@page("write")
def dataset_create_page(request: HttpRequest, principal: Principal) -> HttpResponse:
    post = request.POST
    try:
        seed_raw = post.get("seed", "0") or "0"
        if not seed_raw.lstrip("-").isdigit():
            raise ValidationFailed("seed is a whole number", field="seed")
        temporal = None
        if post.get("test_from"):
            temporal = {
                "field": post.get("temporal_field", "episode_started_at"),
                "test_from": post["test_from"],
            }
            if post.get("validation_from"):
                temporal["validation_from"] = post["validation_from"]
        spec = DatasetSpec(
            name=post.get("name", "")[:200],
            filters={k: post[k] for k in FILTER_FIELDS if post.get(k)},
            group_by=post.get("group_by", "task"),
            fractions={s: _fraction(post.get(s, ""), s) for s in ("train", "validation", "test")},
            seed=int(seed_raw),
            valid_only=post.get("valid_only") == "on",
            temporal=temporal,
        )
        dataset = dataset_create(tenant=principal.tenant, spec=spec, actor=principal.actor)
    except ApiError as exc:
        messages.error(request, f"{exc.field + ': ' if exc.field else ''}{exc.message}")
        return redirect("datasets:list")
    messages.success(request, f"Created {dataset.dataset_id}.")
    return redirect("datasets:card", dataset_id=dataset.dataset_id)


@require_GET
@page()
def dataset_card_page(request: HttpRequest, principal: Principal, dataset_id: str) -> HttpResponse:
    dataset = dataset_get(tenant=principal.tenant, dataset_id=dataset_id)
    card = dataset_card(dataset)
    return render_page(
        request,
        principal,
        "datasets/card.html",
        {
            "nav_section": "datasets",
            "dataset": dataset,
            "card": card,
            # counts in the header's class order (a JSON column does not keep key order)
            "splits": [
                (
                    name,
                    dataset.counts.get(name, {}),
                    [
                        (cls, dataset.counts.get(name, {}).get("by_class", {}).get(cls, 0))
                        for cls in card["by_class"]
                    ],
                )
                for name in ("train", "validation", "test")
            ],
            "classes": list(card["by_class"]),
        },
    )


@require_GET
@page()
def matrix_page(request: HttpRequest, principal: Principal) -> HttpResponse:
    form = {k: request.GET.get(k, "") for k in ("policies", "harnesses", "tasks", "policy_field")}
    form["policy_field"] = form["policy_field"] or "policy_version"
    matrix: dict[str, Any] | None = None
    error = ""
    if form["policies"] or form["harnesses"]:
        try:
            matrix = episode_matrix(
                tenant=principal.tenant,
                policies=form["policies"],
                harnesses=form["harnesses"],
                tasks=form["tasks"],
                policy_field=form["policy_field"],
            )
        except ApiError as exc:
            error = exc.message
    rows: list[dict[str, Any]] = []
    if matrix:
        by = {(c["policy"], c["harness"]): c for c in matrix["cells"]}
        rows = [
            {"policy": p, "cells": [by[(p, h)] for h in matrix["harnesses"]]}
            for p in matrix["policies"]
        ]
    return render_page(
        request,
        principal,
        "datasets/matrix.html",
        {
            "nav_section": "datasets",
            "form": form,
            "policy_fields": POLICY_FIELDS,
            "matrix": matrix,
            "rows": rows,
            "error": error,
        },
    )
