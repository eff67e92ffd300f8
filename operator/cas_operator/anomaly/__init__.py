"""Loop 2: detect anomalous engine pods and drain or replace them.

`detect` decides from the pods' windowed signals (pure), `drain` is the drain state machine
recorded on the pods (pure), `act.anomaly_tick` runs observe -> decide -> act for one resource.
"""
