"""The coordinator's services: the single coordinator and the round owner over MQTT, their
shared main loop, and the ``edge-coordinator`` command."""
