# tracegen's Airflow image: the official Airflow 3.3.2 image (its Python 3.11 build, the Python the project
# declares and constraints.txt was resolved on) plus requirements.txt, with the project's dags/, plugins/ and
# include/ baked in and tracegen installed from them (docker-compose.yaml also mounts them, so edits need no
# rebuild).
ARG AIRFLOW_IMAGE=apache/airflow:3.3.2-python3.11
FROM ${AIRFLOW_IMAGE} AS airflow

# Pinning apache-airflow to the base image's version keeps pip from up- or downgrading Airflow itself
# while resolving the providers (the official image's documented way to add packages); constraints.txt pins
# everything they pull in to the versions the suite passed with.
COPY requirements.txt /requirements.txt
COPY constraints.txt /constraints.txt
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" -c /constraints.txt -r /requirements.txt

COPY --chown=airflow:0 dags/ /opt/airflow/dags/
COPY --chown=airflow:0 plugins/ /opt/airflow/plugins/
COPY --chown=airflow:0 include/ /opt/airflow/include/
# tracegen as a distribution (pyproject.toml reads its dependencies from the requirements files, installed
# above), editable: the image's Python imports it from /opt/airflow/include, which compose mounts over.
COPY --chown=airflow:0 pyproject.toml README.md requirements*.txt /opt/airflow/
RUN pip install --no-cache-dir --no-deps -e /opt/airflow

# A simulated GPU host (docker compose --profile gpu-sim): sshd + tracegen's SGLang stand-in, which the
# fleet launches over SSH exactly as it launches SGLang on a real host. No GPU, no model weights.
FROM airflow AS gpu-sim
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends openssh-server procps \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /run/sshd /home/airflow/.ssh \
    && chown airflow:0 /home/airflow/.ssh && chmod 700 /home/airflow/.ssh \
    && printf 'PasswordAuthentication no\nPermitRootLogin no\nHostKey /etc/ssh/ssh_host_ed25519_key\n' \
       > /etc/ssh/sshd_config.d/tracegen.conf
EXPOSE 22
ENTRYPOINT []
CMD ["/usr/sbin/sshd", "-D", "-e"]

# The default target is the Airflow image every Airflow service runs.
FROM airflow
