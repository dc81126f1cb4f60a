"""What the agent and the coordinator share as running services, beside the wire contract.

``protocol/`` says what goes over the wire; this package is how a service lives: its MQTT
client (``transport``, ``mqtt_client``, ``mqtt_link``, ``bulkread``), configuration loading
(``settings``, ``security``, ``example_config``),
command-line helpers (``cliutil``), stop signals and systemd notification (``lifecycle``,
``sdnotify``), the single-instance lock (``runlock``), crash-safe files (``files``,
``npz``), key files (``keyfiles``), fault injection for tests (``faults``) and the
installed version (``version``).
"""
