from django.urls import path

from apps.trajectories import views

app_name = "trajectories"

urlpatterns = [
    path("", views.episode_list_page, name="list"),
    path("compare", views.episode_compare_page, name="compare"),
    path("<str:episode_id>/", views.episode_detail_page, name="episode"),
    path("<str:episode_id>/relabel", views.episode_relabel_page, name="relabel"),
]
