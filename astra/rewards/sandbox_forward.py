"""The launcher's part for a program that may reach one endpoint and nothing else.

In its network namespace, where nothing outside is reachable (astra.rewards.sandbox), the
launcher brings the loopback interface up, listens on 127.0.0.1:PORT (the port the endpoint
has on the machine, so its URL is the same inside) and forwards each connection to the
endpoint's Unix socket, which it reaches through the file system. It then runs the program
as its child, forwarding until it ends, and exits with its status. `FORWARD` is Python source
that the launcher runs (`_forward(port, path, argv)`); nothing here runs in the service.
"""

FORWARD = """
def _forward(port, path, argv):
    import fcntl, signal, socket, struct, subprocess, threading
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    req = struct.pack("16sH14x", b"lo", 0)
    flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, req))[1]  # SIOCGIFFLAGS
    fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP
    s.close()
    listener = socket.create_server(("127.0.0.1", port))

    def pipe(a, b):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        for sock in (a, b):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def serve():
        while True:
            conn, _ = listener.accept()
            out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                out.connect(path)
            except OSError:
                conn.close()
                out.close()
                continue
            threading.Thread(target=pipe, args=(conn, out), daemon=True).start()
            threading.Thread(target=pipe, args=(out, conn), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return lambda: subprocess.call(argv)
"""
