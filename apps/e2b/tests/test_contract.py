"""Wire details of the E2B layer that need no sandbox."""

from __future__ import annotations

import json
import struct
import urllib.parse

from django.test import RequestFactory

from apps.core.errors import server_error
from apps.e2b import connect
from apps.e2b.services import metadata_filter


def test_it_answers_an_unexpected_error_under_e2b_with_e2bs_json_shape():
    response = server_error(RequestFactory().post("/e2b/v2/sandboxes"))
    body = json.loads(response.content)
    assert response.status_code == 500
    assert body["code"] == 500 and body["message"].startswith("internal error")
    assert body["error"]["code"] == "internal_error"


def test_it_reads_the_sdks_doubly_quoted_metadata_filter():
    # what e2b's SandboxPaginator sends: each key and value quoted, then urlencoded
    pairs = {"run id": "a&b=c", "user": "ann"}
    quoted = {urllib.parse.quote(k): urllib.parse.quote(v) for k, v in pairs.items()}
    assert metadata_filter(urllib.parse.urlencode(quoted)) == pairs
    assert metadata_filter(None) == {} and metadata_filter("") == {}


def test_it_frames_connect_envelopes_and_end_of_stream_errors():
    frame = connect.envelope({"event": {"start": {"pid": 7}}})
    flags, length = struct.unpack(">BI", frame[:5])
    assert (flags, json.loads(frame[5:])) == (0, {"event": {"start": {"pid": 7}}})
    assert length == len(frame) - 5
    end = connect.end_stream(connect.ConnectError("deadline_exceeded", "too slow"))
    assert end[0] == connect.END_STREAM
    assert json.loads(end[5:]) == {"error": {"code": "deadline_exceeded", "message": "too slow"}}
    assert json.loads(connect.end_stream()[5:]) == {}
