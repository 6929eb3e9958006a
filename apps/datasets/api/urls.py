from django.urls import path

from apps.datasets.api import views

# Included before the trajectories API: ``episodes/matrix`` and ``episodes/time`` would
# otherwise be read as episode ids.
urlpatterns = [
    path("datasets", views.DatasetListCreateView.as_view(), name="dataset-list"),
    path("datasets/<str:dataset_id>", views.DatasetDetailView.as_view(), name="dataset-detail"),
    path("datasets/<str:dataset_id>/card", views.DatasetCardView.as_view(), name="dataset-card"),
    path(
        "datasets/<str:dataset_id>/export", views.DatasetExportView.as_view(), name="dataset-export"
    ),
    path("tasks", views.TaskListView.as_view(), name="task-list"),
    path("tasks/difficulty", views.TaskDifficultyBulkView.as_view(), name="task-difficulty-bulk"),
    path("tasks/quarantine", views.TaskQuarantineView.as_view(), name="task-quarantine"),
    path("tasks/<str:task_id>", views.TaskDetailView.as_view(), name="task-detail"),
    path(
        "tasks/<str:task_id>/difficulty", views.TaskDifficultyView.as_view(), name="task-difficulty"
    ),
    path(
        "tasks/<str:task_id>/reference-runs",
        views.ReferenceRunView.as_view(),
        name="task-reference-runs",
    ),
    path(
        "tasks/<str:task_id>/reference-check",
        views.ReferenceCheckView.as_view(),
        name="task-reference-check",
    ),
    path("episodes/matrix", views.EpisodeMatrixView.as_view(), name="episode-matrix"),
    path("episodes/time", views.EpisodesTimeView.as_view(), name="episodes-time"),
    path("episodes/<str:episode_id>/time", views.EpisodeTimeView.as_view(), name="episode-time"),
]
