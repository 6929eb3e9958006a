from django.contrib import admin

from apps.sandboxes.models import Operation, Sandbox, SandboxEvent


@admin.register(Sandbox)
class SandboxAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = [
        "external_id",
        "tenant",
        "state",
        "generation",
        "image",
        "isolation",
        "created_at",
    ]
    list_filter = ["state", "tenant", "backend"]
    search_fields = ["external_id", "id"]
    # Only services/lifecycle.py moves a sandbox (ledger and usage ledger with it).
    readonly_fields = ["state", "generation"]


@admin.register(SandboxEvent)
class SandboxEventAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["at", "sandbox", "event", "from_state", "to_state", "reason", "actor"]
    list_filter = ["event", "reason"]

    def has_change_permission(self, request: object, obj: object = None) -> bool:
        return False  # the ledger is append-only


@admin.register(Operation)
class OperationAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ["operation_id", "sandbox", "status", "termination", "exit_code", "created_at"]
    list_filter = ["status", "termination"]
