"""Rules and names every layer shares, at the bottom of the package so that anything may import them: the one
cap rule (`cap_rule`), where a run may read and write (`locations`), the DAG and task ids other code reads
Airflow's metadata by (`dag_ids`), an Airflow HTTP connection as a URL and headers (`http_connection`), and
the Celery executor's settings (`celery_config`)."""
