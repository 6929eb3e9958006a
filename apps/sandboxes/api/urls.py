from django.urls import path

from apps.sandboxes.api import audits, files, snapshots, views

urlpatterns = [
    path("sandboxes", views.SandboxListCreateView.as_view(), name="sandbox-list"),
    path("sandboxes/<str:sandbox_id>", views.SandboxDetailView.as_view(), name="sandbox-detail"),
    path("sandboxes/<str:sandbox_id>/wait", views.SandboxWaitView.as_view(), name="sandbox-wait"),
    path(
        "sandboxes/<str:sandbox_id>/heartbeat",
        views.SandboxHeartbeatView.as_view(),
        name="sandbox-heartbeat",
    ),
    path(
        "sandboxes/<str:sandbox_id>/dns-log",
        views.SandboxDnsLogView.as_view(),
        name="sandbox-dns-log",
    ),
    path(
        "sandboxes/<str:sandbox_id>/dns",
        views.SandboxDnsLogView.as_view(),
        name="sandbox-dns",
    ),
    path(
        "sandboxes/<str:sandbox_id>/metrics",
        views.SandboxMetricsView.as_view(),
        name="sandbox-metrics",
    ),
    path(
        "sandboxes/<str:sandbox_id>/timeout",
        views.SandboxTimeoutView.as_view(),
        name="sandbox-timeout",
    ),
    path(
        "sandboxes/<str:sandbox_id>/events",
        views.SandboxEventsView.as_view(),
        name="sandbox-events",
    ),
    path("sandboxes/<str:sandbox_id>/exec", views.ExecView.as_view(), name="sandbox-exec"),
    path(
        "sandboxes/<str:sandbox_id>/apply_patch",
        views.ApplyPatchView.as_view(),
        name="sandbox-apply-patch",
    ),
    path(
        "sandboxes/<str:sandbox_id>/operations",
        views.OperationListView.as_view(),
        name="operation-list",
    ),
    path(
        "sandboxes/<str:sandbox_id>/operations/<str:operation_id>",
        views.OperationDetailView.as_view(),
        name="operation-detail",
    ),
    path(
        "sandboxes/<str:sandbox_id>/operations/<str:operation_id>/cancel",
        views.OperationCancelView.as_view(),
        name="operation-cancel",
    ),
    path(
        "sandboxes/<str:sandbox_id>/operations/<str:operation_id>/stdin",
        views.OperationStdinView.as_view(),
        name="operation-stdin",
    ),
    path("sandboxes/<str:sandbox_id>/files", files.FilesView.as_view(), name="sandbox-files"),
    path(
        "sandboxes/<str:sandbox_id>/files/list",
        files.FileListView.as_view(),
        name="sandbox-files-list",
    ),
    path(
        "sandboxes/<str:sandbox_id>/files/archive",
        files.TreeView.as_view(),
        name="sandbox-files-archive",
    ),
    path(
        "sandboxes/<str:sandbox_id>/files/mkdir",
        files.FileMkdirView.as_view(),
        name="sandbox-files-mkdir",
    ),
    path(
        "sandboxes/<str:sandbox_id>/files/rename",
        files.FileRenameView.as_view(),
        name="sandbox-files-rename",
    ),
    path(
        "sandboxes/<str:sandbox_id>/files/watch",
        files.FileWatchView.as_view(),
        name="sandbox-files-watch",
    ),
    path(
        "sandboxes/<str:sandbox_id>/files/watch/<str:watcher_id>",
        files.FileWatcherView.as_view(),
        name="sandbox-files-watcher",
    ),
    path(
        "sandboxes/<str:sandbox_id>/files/stat",
        files.FileStatView.as_view(),
        name="sandbox-files-stat",
    ),
    path(
        "sandboxes/<str:sandbox_id>/snapshots",
        snapshots.SandboxSnapshotsView.as_view(),
        name="sandbox-snapshots",
    ),
    path(
        "sandboxes/<str:sandbox_id>/pause",
        snapshots.SandboxPauseView.as_view(),
        name="sandbox-pause",
    ),
    path(
        "sandboxes/<str:sandbox_id>/resume",
        snapshots.SandboxResumeView.as_view(),
        name="sandbox-resume",
    ),
    path("snapshots", snapshots.SnapshotListView.as_view(), name="snapshot-list"),
    path(
        "snapshots/<str:snapshot_id>",
        snapshots.SnapshotDetailView.as_view(),
        name="snapshot-detail",
    ),
    path(
        "snapshots/<str:snapshot_id>/fork",
        snapshots.SnapshotForkView.as_view(),
        name="snapshot-fork",
    ),
    path("audits", audits.AuditListView.as_view(), name="audit-list"),
    path("audits/<int:audit_id>", audits.AuditDetailView.as_view(), name="audit-detail"),
]
