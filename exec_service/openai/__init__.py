"""The execute service's HTTP front: an OpenAI-compatible gateway (``kiln api-server``) over Kiln's gRPC API.

app.py routes the endpoints; requests.py maps OpenAI's bodies to GenerateRequests; responses.py and streaming.py
turn the streamed GenerateResponses back into OpenAI's objects and server-sent events; errors.py gives every
failure OpenAI's error object; exec_client.py is the only module that calls gRPC. Stateless: any number of
gateways may stand in front of any number of execute services.
"""
