"""The on-device agent: features, head training, prototypes, privacy and the MQTT loop."""
