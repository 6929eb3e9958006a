from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from apps.tenancy.models import Tenant
from apps.tenancy.services import api_key_create, membership_set_role, tenant_create


class Command(BaseCommand):
    help = "Creates a tenant (if missing) and a new API key for it; prints the key once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug")
        parser.add_argument("--name", default="")
        parser.add_argument("--key-name", default="default")
        parser.add_argument("--scopes", default="read,write,admin")
        parser.add_argument("--owner", help="username to make owner (created if missing)")
        parser.add_argument("--owner-password", help="password for a newly created owner")
        parser.add_argument("--quiet", action="store_true", help="print only the key")

    def handle(self, *args: Any, **opts: Any) -> None:
        slug: str = opts["slug"]
        with transaction.atomic():
            tenant = Tenant.objects.filter(slug=slug).first()
            if tenant is None:
                tenant = tenant_create(slug=slug, name=opts["name"] or slug)
            if opts["owner"]:
                user, created = User.objects.get_or_create(username=opts["owner"])
                if created:
                    if not opts["owner_password"]:
                        raise CommandError("--owner-password is required for a new user")
                    user.set_password(opts["owner_password"])
                    user.save()
                membership_set_role(tenant=tenant, user=user, role="owner")
            issued = api_key_create(
                tenant=tenant,
                name=opts["key_name"],
                scopes=[s for s in opts["scopes"].split(",") if s],
            )
        if opts["quiet"]:
            self.stdout.write(issued.secret)
        else:
            self.stdout.write(f"tenant: {tenant.slug}\napi key (shown once): {issued.secret}")
