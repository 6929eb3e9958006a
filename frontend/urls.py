from django.urls import path

from frontend import file_views, operation_views, snapshot_views, team_views, views

app_name = "frontend"

urlpatterns = [
    path("", views.home, name="home"),
    path("login/", team_views.LoginView.as_view(), name="login"),
    path("logout/", team_views.LogoutView.as_view(), name="logout"),
    path("team/switch", team_views.team_switch, name="team-switch"),
    path("sandboxes/", views.sandbox_list, name="sandboxes"),
    path("sandboxes/table", views.sandbox_table, name="sandbox-table"),
    path("sandboxes/new", views.sandbox_create_view, name="sandbox-create"),
    path("sandboxes/delete", views.sandbox_bulk_delete_view, name="sandbox-bulk-delete"),
    path("sandboxes/quota", views.sandbox_quota, name="sandbox-quota"),
    path("sandboxes/<str:sandbox_id>/", views.sandbox_detail, name="sandbox"),
    path("sandboxes/<str:sandbox_id>/header", views.sandbox_header, name="sandbox-header"),
    path("sandboxes/<str:sandbox_id>/timeline", views.sandbox_timeline, name="sandbox-timeline"),
    path(
        "sandboxes/<str:sandbox_id>/operations",
        views.sandbox_operations,
        name="sandbox-operations",
    ),
    path(
        "sandboxes/<str:sandbox_id>/operations/<str:operation_id>/output",
        operation_views.operation_output,
        name="operation-output",
    ),
    path(
        "sandboxes/<str:sandbox_id>/operations/<str:operation_id>/output.txt",
        operation_views.operation_output_download,
        name="operation-output-download",
    ),
    path("sandboxes/<str:sandbox_id>/files", views.sandbox_files, name="sandbox-files"),
    path(
        "sandboxes/<str:sandbox_id>/files/delete",
        file_views.sandbox_file_delete,
        name="sandbox-file-delete",
    ),
    path(
        "sandboxes/<str:sandbox_id>/files/mkdir",
        file_views.sandbox_file_mkdir,
        name="sandbox-file-mkdir",
    ),
    path(
        "sandboxes/<str:sandbox_id>/files/exists",
        file_views.sandbox_file_exists,
        name="sandbox-file-exists",
    ),
    path("sandboxes/<str:sandbox_id>/delete", views.sandbox_delete_view, name="sandbox-delete"),
    path("sandboxes/<str:sandbox_id>/ttl", views.sandbox_ttl_view, name="sandbox-ttl"),
    path("sandboxes/<str:sandbox_id>/pause", views.sandbox_pause_view, name="sandbox-pause"),
    path("sandboxes/<str:sandbox_id>/resume", views.sandbox_resume_view, name="sandbox-resume"),
    path("snapshots/<str:snapshot_id>/", snapshot_views.snapshot_detail, name="snapshot"),
    path(
        "snapshots/<str:snapshot_id>/fork", snapshot_views.snapshot_fork_view, name="snapshot-fork"
    ),
    path("keys/", team_views.keys, name="keys"),
    path("keys/<str:key_id>/revoke", team_views.key_revoke, name="key-revoke"),
    path("keys/<str:key_id>/rename", team_views.key_rename, name="key-rename"),
    path("keys/<str:key_id>/rotate", team_views.key_rotate, name="key-rotate"),
    path("activity/", team_views.activity_page, name="activity"),
    path("members/", team_views.members, name="members"),
]
