"""The error envelope names the field that is wrong, also inside lists of objects."""

from __future__ import annotations

from rest_framework import serializers

from apps.core.errors import _first_error


class _Item(serializers.Serializer[dict[str, object]]):
    kind = serializers.ChoiceField(choices=["a", "b"])


class _Body(serializers.Serializer[dict[str, object]]):
    items = _Item(many=True)
    tags = serializers.ListField(child=serializers.IntegerField())


def _errors(data: dict[str, object]) -> tuple[str | None, str, str]:
    body = _Body(data=data)
    assert not body.is_valid()
    return _first_error(body.errors)


def test_a_bad_item_after_good_ones_is_named_by_its_index() -> None:
    field, message, code = _errors(
        {"items": [{"kind": "a"}, {"kind": "a"}, {"kind": "z"}], "tags": []}
    )
    assert field == "items.2.kind"
    assert code == "invalid_choice"
    assert "z" in message


def test_a_bad_list_element_is_named_by_its_index() -> None:
    field, _, code = _errors({"items": [], "tags": [1, "x"]})
    assert field == "tags.1"
    assert code == "invalid"


def test_a_plain_field_error_keeps_the_field_name() -> None:
    field, message, code = _errors({"tags": []})
    assert field == "items"
    assert code == "required"
    assert message
