from django.urls import path

from apps.trajectories.api import views

urlpatterns = [
    path("episodes", views.EpisodeListCreateView.as_view(), name="episode-list"),
    path("episodes/provenance", views.EpisodeProvenanceView.as_view(), name="episode-provenance"),
    path("episodes/scan", views.EpisodeScanView.as_view(), name="episode-scan"),
    path(
        "episodes/secrets/report", views.SecretsReportView.as_view(), name="episode-secrets-report"
    ),
    path(
        "episodes/secrets/access", views.SecretAccessView.as_view(), name="episode-secrets-access"
    ),
    path("lineage/withdrawals", views.WithdrawalView.as_view(), name="lineage-withdrawals"),
    path("lineage/tombstones", views.TombstoneListView.as_view(), name="lineage-tombstones"),
    path("episodes/stats", views.EpisodeStatsView.as_view(), name="episode-stats"),
    path("episodes/export", views.EpisodeExportView.as_view(), name="episode-export"),
    path("episodes/import", views.EpisodeImportView.as_view(), name="episode-import"),
    path("episodes/compare", views.EpisodeCompareView.as_view(), name="episode-compare"),
    path("episodes/<str:episode_id>", views.EpisodeDetailView.as_view(), name="episode-detail"),
    path(
        "episodes/<str:episode_id>/steps",
        views.StepListAppendView.as_view(),
        name="episode-steps",
    ),
    path(
        "episodes/<str:episode_id>/sandboxes",
        views.EpisodeSandboxView.as_view(),
        name="episode-sandboxes",
    ),
    path("episodes/<str:episode_id>/close", views.EpisodeCloseView.as_view(), name="episode-close"),
    path(
        "episodes/<str:episode_id>/attribute",
        views.EpisodeAttributeView.as_view(),
        name="episode-attribute",
    ),
    path(
        "episodes/<str:episode_id>/relabel",
        views.EpisodeRelabelView.as_view(),
        name="episode-relabel",
    ),
    path(
        "episodes/<str:episode_id>/branches",
        views.EpisodeBranchesView.as_view(),
        name="episode-branches",
    ),
    path(
        "episodes/<str:episode_id>/counterfactual",
        views.EpisodeCounterfactualView.as_view(),
        name="episode-counterfactual",
    ),
    path(
        "episodes/<str:episode_id>/branch-advice",
        views.EpisodeBranchAdviceView.as_view(),
        name="episode-branch-advice",
    ),
    path(
        "episodes/<str:episode_id>/secrets",
        views.EpisodeSecretsView.as_view(),
        name="episode-secrets",
    ),
    path(
        "episodes/<str:episode_id>/lineage",
        views.EpisodeLineageView.as_view(),
        name="episode-lineage",
    ),
    path(
        "episodes/<str:episode_id>/raw-events",
        views.EpisodeRawEventsView.as_view(),
        name="episode-raw-events",
    ),
    path(
        "episodes/<str:episode_id>/layers",
        views.EpisodeLayersView.as_view(),
        name="episode-layers",
    ),
    path(
        "episodes/<str:episode_id>/layers/<str:layer_id>",
        views.EpisodeLayerDetailView.as_view(),
        name="episode-layer",
    ),
    path(
        "episodes/<str:episode_id>/layers/<str:layer_id>/items/<int:position>/trace",
        views.LayerItemTraceView.as_view(),
        name="episode-layer-item-trace",
    ),
    path(
        "episodes/<str:episode_id>/timeline",
        views.EpisodeTimelineView.as_view(),
        name="episode-timeline",
    ),
]
