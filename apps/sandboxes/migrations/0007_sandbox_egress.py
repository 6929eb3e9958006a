from django.db import migrations, models

import apps.sandboxes.models


class Migration(migrations.Migration):
    dependencies = [
        ("sandboxes", "0006_sandbox_image_digest_progress"),
    ]

    operations = [
        migrations.AddField(
            model_name="sandbox",
            name="egress",
            field=models.JSONField(default=apps.sandboxes.models.egress_default),
        ),
        # network_access: true was egress "all"
        migrations.RunSQL(
            """UPDATE sandboxes_sandbox SET egress = '"all"'::jsonb WHERE network_access""",
            migrations.RunSQL.noop,
        ),
    ]
