# One image for web, worker, beat and watcher. The local backend needs root, network
# namespaces and bubblewrap, so worker/watcher run privileged in compose.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends \
      bubblewrap nftables iproute2 procps curl nodejs npm python3 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements.txt /app/
RUN pip install --no-cache-dir -r requirements.txt
COPY . /app
RUN pip install --no-cache-dir ./sdk \
    && (cd frontend && if [ -f package.json ]; then npm ci && npm run build; fi) \
    && python manage.py collectstatic --noinput
ENV DJANGO_SETTINGS_MODULE=controlplane.settings PYTHONUNBUFFERED=1
EXPOSE 8000
CMD ["uvicorn", "controlplane.asgi:application", "--host", "0.0.0.0", "--port", "8000"]
