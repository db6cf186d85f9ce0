package systems

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is a server process this tool started; it is stopped by its pid.
type proc struct {
	name string
	log  string
	cmd  *exec.Cmd
	done chan struct{}
}

// startProc starts bin with args and env (nothing inherited but PATH and
// HOME), its output in the file log. The process has its own process group,
// so that a Ctrl-C reaches this tool only and the systems are stopped in
// order, and is killed if this tool dies (Pdeathsig).
func startProc(name, log string, env []string, bin string, args ...string) (*proc, error) {
	f, err := os.Create(log)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, log: log, cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM to the process (its pid only), and SIGKILL when it
// has not exited 5 s later.
func (p *proc) stop() {
	if p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// failed describes a process that exited, with the end of its log.
func (p *proc) failed() error {
	return fmt.Errorf("%s exited (%s); its log ends:\n%s", p.name, p.cmd.ProcessState, tail(p.log, 15))
}

// tail is the last n lines of the file at path.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(" + err.Error() + ")"
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return "  " + strings.Join(lines, "\n  ")
}

// waitReady polls ready every 50 ms until it returns nil, for at most
// timeout; it gives up early when one of procs exits.
func waitReady(ctx context.Context, timeout time.Duration, ready func(context.Context) error, procs ...*proc) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		for _, p := range procs {
			if p.exited() {
				return p.failed()
			}
		}
		err := ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not ready after %s: %w", timeout, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// cpuTicks is a process's user + system CPU time in clock ticks, from
// /proc/PID/stat (fields 14 and 15).
func cpuTicks(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	return parseStat(b)
}

// parseStat reads utime + stime of a /proc/PID/stat line. The command name
// (field 2) is in parentheses and may hold spaces: fields are counted from
// the last ')'.
func parseStat(b []byte) (uint64, error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, errors.New("/proc stat: no ')'")
	}
	f := strings.Fields(string(b[i+1:]))
	// f[0] is field 3 (state): utime is field 14, stime field 15.
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc stat: %d fields after the name", len(f))
	}
	u, err := strconv.ParseUint(f[11], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("/proc stat utime: %w", err)
	}
	s, err := strconv.ParseUint(f[12], 10, 64)
	if err != nil {
		return 0, fmt.Errorf("/proc stat stime: %w", err)
	}
	return u + s, nil
}

// TicksPerSecond is USER_HZ, the unit of /proc/PID/stat's times: 100 on
// every Linux architecture Go runs on (the kernel reports in USER_HZ
// whatever its own HZ).
const TicksPerSecond = 100

// ports hands out free loopback ports, never the same one twice in a run.
type ports struct {
	mu   sync.Mutex
	used map[int]bool
}

// Ports are drawn from this range, below the kernel's ephemeral ports
// (32768-60999 by default), which outgoing connections take theirs from:
// a port and its Redis Cluster bus (port + 10000) both stay below them.
const (
	portLow  = 20000
	portHigh = 22700
)

// get returns a port free on 127.0.0.1 for TCP; with bus, port + 10000 is
// free too (a Redis Cluster node's bus); with udp, the port is free for
// UDP as well (memberlist).
func (p *ports) get(bus, udp bool) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.used == nil {
		p.used = make(map[int]bool)
	}
	for range 1000 {
		port := portLow + rand.IntN(portHigh-portLow)
		if p.used[port] || p.used[port+10000] || !freeTCP(port) || (bus && !freeTCP(port+10000)) || (udp && !freeUDP(port)) {
			continue
		}
		p.used[port] = true
		if bus {
			p.used[port+10000] = true
		}
		return port, nil
	}
	return 0, errors.New("no free loopback port found")
}

func freeTCP(port int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	l.Close()
	return true
}

func freeUDP(port int) bool {
	c, err := net.ListenPacket("udp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	c.Close()
	return true
}

func addr(port int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) }
