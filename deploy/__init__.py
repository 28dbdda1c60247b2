"""What deploys the services: the Helm chart (deploy/helm) and the dashboards it ships (deploy/dashboards)."""
